"""Completion webhooks from the worker side: each worker's courier claims due deliveries from
Postgres and sends them, signed, on its own threads, never a chunk's (docs/architecture.md,
"Webhooks")."""
