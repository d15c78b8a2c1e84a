"""The `ObjectStore` protocol and key checks (the URL factory is `kiln.app.storage.open_store`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

# Returns a boto3 S3 client, made only when needed: the API's and the services' way to read a
# tenant's bucket without importing boto3 until an s3:// URI is met.
S3Factory = Callable[[], Any]


class NewObject(NamedTuple):
    key: str
    data: bytes
    content_type: str | None = None


class StoreSettings(Protocol):
    """What opening a store reads of the settings: `Settings`, or the plain copy a prep process
    gets (`kiln.workers.prep.settings`), which imports no pydantic."""

    @property
    def storage_url(self) -> str: ...

    @property
    def s3_endpoint_url(self) -> str | None: ...

    @property
    def s3_region(self) -> str: ...


class ObjectStore(Protocol):
    """Keys are `/`-separated paths relative to the store's root."""

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None: ...

    def put_new(self, objects: Sequence[NewObject]) -> None:
        """Write objects no reader looks for yet (a job's uploads, before the job's row
        exists): as fast as the store allows, without `put`'s guard against half-read ones."""

    def get(self, key: str) -> bytes: ...

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[str]: ...

    def delete(self, key: str) -> None: ...

    def ping(self) -> None:
        """Raise if the store cannot be reached."""

    def describe(self, key: str) -> str:
        """A URL a human can use to find `key` (s3://… or file://…)."""

    def presign(self, key: str, seconds: int) -> str:
        """A URL anyone holding it can GET `key` with for `seconds`, no Kiln key needed.

        Raises ConflictError where the store cannot make one (a local folder)."""


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{key!r} is not a valid object key.")
    return key
