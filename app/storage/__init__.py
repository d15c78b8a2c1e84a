"""Object storage: one protocol, a local folder and S3 behind it."""

from kiln.app.storage.base import ObjectStore, open_store

__all__ = ["ObjectStore", "open_store"]
