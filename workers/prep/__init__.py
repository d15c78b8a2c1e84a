"""The prep half of the data plane: processes that fetch, hash, check and decode inputs into
shared-memory slots, so the engine-owning process never decodes (docs/architecture.md)."""
