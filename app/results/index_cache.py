"""The API's cache of loaded vector indexes: least recently used first out, bounded in bytes.

A job's index is built once when it closes and never changes after, so a loaded copy stays
good for as long as it is kept. Small indexes are read into memory; from `MMAP_FROM` bytes on,
an index is downloaded to a file of this cache's own folder and memory-mapped (usearch's
`view`): its pages are the kernel's page cache, which the kernel can take back under pressure,
so the process's own memory holds only the keys. Either way an index counts its full size
against the budget: a search touches a good part of it.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from kiln.app.core.errors import ConflictError, TransientError
from kiln.app.results import vector_index
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex

MMAP_FROM = 64 * 1024**2  # below it a read into memory is quicker than a file and a mapping
KEY_BYTES = 120  # a key's share of memory: its string and its two dict entries, roughly
# usearch's loaded size over its stored one (its allocator's slack): 273 vs 209 MiB for
# 100,000 vectors of 512 dimensions. Its own `memory_usage` also counts address space it
# reserved and never touched (16 MiB for a 200-vector index), so it is not what is counted.
SLACK = 1.3


class IndexCache:
    def __init__(self, max_bytes: int, mmap_from: int = MMAP_FROM) -> None:
        self.max_bytes = max_bytes
        self.mmap_from = mmap_from
        self._entries: OrderedDict[str, tuple[VectorIndex, int]] = OrderedDict()
        self._loading: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._folder: Path | None = None

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._entries

    @property
    def folder(self) -> Path | None:
        """Where memory-mapped indexes are kept (made on first use, removed by `close`)."""
        return self._folder

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._entries.values())

    def get(self, name: str, place: Place, label: str | None = None) -> VectorIndex:
        """The index stored under `place`, cached as `name` (a job id); one load at a time
        per name, so a burst of searches of one job reads its index once. `label` names what
        is searched in a refusal (default: "job <name>")."""
        if (found := self._cached(name)) is not None:
            return found
        with self._lock:
            loading = self._loading.setdefault(name, threading.Lock())
        with loading:
            try:
                if (found := self._cached(name)) is not None:
                    return found
                index, size = self._load(name, place, label or f"job {name}")
                self._keep(name, index, size)
                return index
            finally:
                with self._lock:
                    self._loading.pop(name, None)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _cached(self, name: str) -> VectorIndex | None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return None
            self._entries.move_to_end(name)
            return entry[0]

    def _load(self, name: str, place: Place, label: str) -> tuple[VectorIndex, int]:
        stored = vector_index.stored_bytes(place)
        self._check_fits(label, int(stored * SLACK))
        index = vector_index.load(place, self._file(name) if stored >= self.mmap_from else None)
        if len(index.index) != len(index):
            # A pipeline run rewrites its library's index and keys as two objects, in place:
            # this read fell between the two.
            self._forget_file(name)
            raise TransientError(
                f"The vector index of {label} is being updated; search again in a moment."
            )
        size = int(stored * SLACK) + KEY_BYTES * len(index)
        self._check_fits(label, size)
        return index, size

    def _check_fits(self, label: str, size: int) -> None:
        if size > self.max_bytes:
            raise ConflictError(
                f"The vector index of {label} takes {_mib(size)}, more than this API keeps "
                f"loaded for search ({_mib(self.max_bytes)}, KILN_SEARCH_CACHE_BYTES); an "
                "operator can raise it, with the API's memory limit."
            )

    def _keep(self, name: str, index: VectorIndex, size: int) -> None:
        """Add the entry, then drop the least recently used until the rest fits."""
        with self._lock:
            self._entries[name] = (index, size)
            total = sum(s for _, s in self._entries.values())
            while total > self.max_bytes:
                old, (_, old_size) = self._entries.popitem(last=False)
                total -= old_size
                self._forget_file(old)

    def _file(self, name: str) -> Path:
        with self._lock:
            if self._folder is None:
                self._folder = Path(tempfile.mkdtemp(prefix="kiln-indexes-"))
            return self._folder / f"{name}.usearch"

    def _forget_file(self, name: str) -> None:
        """A mapped index's file goes with its entry; a search still holding the index keeps
        its mapping (POSIX unlinks a mapped file's name, not its pages)."""
        if self._folder is not None:
            (self._folder / f"{name}.usearch").unlink(missing_ok=True)


def _mib(size: int) -> str:
    return f"{size / 1024**2:,.1f} MiB"
