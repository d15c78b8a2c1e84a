"""Object storage: one protocol (`base`), a local folder (`local`) and S3 (`s3`) behind it."""

from __future__ import annotations

from urllib.parse import urlparse

from kiln.app.storage.base import ObjectStore, StoreSettings

__all__ = ["ObjectStore", "StoreSettings", "open_store"]


def open_store(settings: StoreSettings) -> ObjectStore:
    """Open the store named by `KILN_STORAGE_URL`."""
    url = settings.storage_url
    scheme = urlparse(url).scheme
    if scheme == "file":
        from kiln.app.storage.local import LocalStore

        return LocalStore.from_url(url)
    if scheme == "s3":
        from kiln.app.storage.s3 import S3Store, make_s3_client

        return S3Store.from_url(url, make_s3_client(settings), own=True)
    raise ValueError(f"KILN_STORAGE_URL must start with s3:// or file://, not {url!r}.")
