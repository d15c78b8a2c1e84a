"""Kiln: queue-driven batch inference.

The one import name of the distribution. Its subpackages are the repository's top-level folders
(`kiln/app` → `app/`, `kiln/workers` → `workers/`, `kiln/migrations` → `migrations/`, linked so
the layout stays as the product is known by while nothing generic lands on a user's `sys.path`).
"""
