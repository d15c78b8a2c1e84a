"""A folder as an object store: the embedded default, and what tests compare S3 against."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from kiln.app.core.errors import ConflictError, NotFoundError, SetupError
from kiln.app.storage.base import NewObject, check_key


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    @classmethod
    def from_url(cls, url: str) -> LocalStore:
        return cls(Path(unquote(urlparse(url).path)))

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a reader never sees half an object.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        Path(tmp).replace(path)

    def put_new(self, objects: Sequence[NewObject]) -> None:
        """Straight into place: nothing reads these keys until the job that names them
        commits (a temporary file and a rename per object cost more than the write)."""
        folders: set[Path] = set()
        for key, data, _content_type in objects:
            path = self._path(key)
            if path.parent not in folders:
                path.parent.mkdir(parents=True, exist_ok=True)
                folders.add(path.parent)
            path.write_bytes(data)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFoundError(f"No object at {self.describe(key)}.") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> Iterator[str]:
        if not self.root.is_dir():
            return
        folder = prefix.rpartition("/")[0]  # walk only below the prefix's folder
        start = self.root / folder if folder else self.root
        if not start.is_dir():
            return
        keys = (
            path.relative_to(self.root).as_posix()
            for path in start.rglob("*")
            if path.is_file() and not path.name.startswith(".tmp-")
        )
        # Whole-key order, as S3 lists (not folder by folder).
        yield from sorted(k for k in keys if k.startswith(prefix))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def ping(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SetupError(
                f"Kiln's storage folder {self.root} cannot be created "
                f"({error.strerror or error}); fix KILN_STORAGE_URL or the folder's permissions."
            ) from error
        if not os.access(self.root, os.W_OK):
            raise SetupError(
                f"Kiln's storage folder {self.root} is not writable; fix KILN_STORAGE_URL or "
                "the folder's permissions."
            )

    def describe(self, key: str) -> str:
        return self._path(key).as_uri()

    def presign(self, key: str, seconds: int) -> str:
        raise ConflictError(
            f"Presigned URLs need S3 storage; {self.describe(key)} is in a local folder."
        )
