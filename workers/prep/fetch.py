"""Fetch an item's bytes from wherever its source points."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from kiln.app import sources
from kiln.app.core.errors import InputError
from kiln.app.storage import ObjectStore
from kiln.workers.prep.settings import PrepSettings


def _read_local(uri: str, max_bytes: int) -> bytes:
    return read_file(Path(unquote(_uri_path(uri))), max_bytes)


_NOT_PLAIN = set("?#\t\r\n")  # what urlparse would split off or drop from a file URI


def _uri_path(uri: str) -> str:
    """A `file:///…` URI's path, as `urlparse(uri).path`: cut out where nothing in it is
    special (the usual URI, as `Path.as_uri` writes it), else parsed."""
    if uri.startswith("file:///") and _NOT_PLAIN.isdisjoint(uri) and uri.isprintable():
        return uri[7:]
    return urlparse(uri).path


def read_file(path: Path, max_bytes: int) -> bytes:
    """A local file's bytes: one open, one fstat and (for a file as large as it says) one
    read — a prep process's cheapest way in, with the same sentences as a stat then a read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"There is no file at {path}.") from None
    except PermissionError:
        _over(path, _size(path), max_bytes)  # too large says so first, as a stat would
        raise InputError(f"{path} cannot be read (permission denied).") from None
    try:
        size = os.fstat(fd).st_size
        _over(path, size, max_bytes)
        return _read_all(fd, size, max_bytes)
    except IsADirectoryError:
        raise InputError(f"There is no file at {path}.") from None
    finally:
        os.close(fd)


def _read_all(fd: int, size: int, max_bytes: int) -> bytes:
    """What `fd` holds, to its end: a regular file in one read (one byte more than its size,
    to see it end); a pipe, or a file that grew, in more (never far past `max_bytes`)."""
    parts = [os.read(fd, size + 1)]
    if len(parts[0]) <= size:  # short of the byte asked past its size: its end
        return parts[0]
    total = len(parts[0])
    while parts[-1] and total <= max_bytes:
        parts.append(os.read(fd, 1 << 20))
        total += len(parts[-1])
    return parts[0] if len(parts) == 2 and not parts[1] else b"".join(parts)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _over(path: Path, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise InputError(f"{path} is {size:,} bytes, over the {max_bytes:,} limit.")


class Fetcher:
    """`store:<key>` reads Kiln's own store; `s3://bucket/key` reads any bucket; `file:///…`
    reads this machine's files, only where `local_inputs` is set (`kiln run`). The forms are
    `kiln.app.sources`."""

    def __init__(self, settings: PrepSettings, store: ObjectStore) -> None:
        self.settings = settings
        self.store = store
        self._s3: Any = None
        self._local: tuple[str | None, Path] = (None, Path())  # the last `local_path` found
        self._lock = threading.Lock()

    def s3_client(self) -> Any:
        with self._lock:  # boto3 clients are thread-safe once built, but building is not
            if self._s3 is None:
                from kiln.app.storage.s3 import make_s3_client  # boto3: only where S3 is read

                self._s3 = make_s3_client(self.settings)
            return self._s3

    def local_path(self, source: str | None) -> Path | None:
        """The file a `file://` source names, where this process may read it (else None)."""
        if source and source.startswith("file:///") and self.settings.local_inputs:
            self._local = (source, Path(unquote(_uri_path(source))))
            return self._local[1]
        return None

    def fetch(self, source: str | None, max_bytes: int) -> bytes:
        if not source:
            raise InputError("The item has no source to read.")
        if (key := sources.store_key(source)) is not None:
            data = self.store.get(key)
        elif source.startswith("s3://"):
            data = self._fetch_s3(source, max_bytes)
        elif source.startswith("file:///") and self.settings.local_inputs:
            known, path = self._local  # the handler asked `local_path` for it first
            data = read_file(path, max_bytes) if known is source else _read_local(source, max_bytes)
        else:
            raise InputError(f"Kiln cannot read {source!r}; use s3:// URIs or uploads.")
        if len(data) > max_bytes:
            raise InputError(f"The object is {len(data):,} bytes, over the {max_bytes:,} limit.")
        return data

    def _fetch_s3(self, uri: str, max_bytes: int) -> bytes:
        from kiln.app.storage.s3 import read_object

        return read_object(self.s3_client(), uri, max_bytes)
