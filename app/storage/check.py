"""`kiln storage check`: Kiln's own store is there and works (a probe written, read back and
deleted), its bucket or folder created where asked."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

from kiln.app.core.errors import SetupError
from kiln.app.storage.base import ObjectStore
from kiln.app.storage.local import LocalStore
from kiln.app.storage.s3 import S3Store, missing_bucket

PROBE = b"kiln storage check"


def check_store(store: ObjectStore, create: bool = False) -> Iterator[str]:
    """What was found and done, a sentence at a time; raises a `KilnError` with its sentence
    (a `SetupError` for a missing bucket) where the store does not work."""
    if isinstance(store, S3Store):
        if store.bucket_exists():
            yield f"The bucket {store.bucket} exists."
        elif create:
            store.create_bucket()
            yield f"Created the bucket {store.bucket}."
        else:
            raise missing_bucket(store.bucket)
    elif isinstance(store, LocalStore):  # Kiln makes its folder itself, --create or not
        existed = store.root.is_dir()
        store.ping()
        yield f"The folder {store.root} exists." if existed else f"Created the folder {store.root}."
    key = f"kiln-storage-check/{secrets.token_hex(4)}"
    store.put(key, PROBE, "text/plain")
    try:
        if store.get(key) != PROBE:
            raise SetupError(f"{store.describe(key)} read back other bytes than were written.")
    finally:
        store.delete(key)
    if store.exists(key):
        raise SetupError(f"{store.describe(key)} is still there after it was deleted.")
    yield f"Wrote, read back and deleted {store.describe(key)}: the store works."
