"""Shared-memory slots: where prep processes put a model's decoded inputs for the engine process.

A `SlotPool` is one segment of fixed-shape slots (uint8, the model's input size and layout),
made and owned by the engine-owning process. A slot is owned by exactly one party at a time:

    free ──acquire (chunk thread)──► lent to a prep process (it writes the pixels)
         ◄──release (chunk thread)── read by the engine's batch (the block has settled)

The segment is a file under /dev/shm named `kiln-<owner pid>-<model>-<token>`, opened by name
in the prep processes. Its space is reserved when it is made (`posix_fallocate`: a full
/dev/shm is an error then, not a SIGBUS in a prep process later), and its owner holds a lock on
it for as long as it lives. It is unlinked when its pool closes; a worker killed with SIGKILL
cannot, so `reclaim` (run when a worker starts) removes every segment whose lock it can take —
its owner is gone, whatever PID namespace it ran in. Python's `multiprocessing.shared_memory`
is not used: on 3.11 it registers every attach with the resource tracker, which then unlinks
the owner's segment when a prep process exits.

A `Lender` is the same bookkeeping without memory: object families (OCR pages, token ids)
borrow its tickets so that what is in prep stays bounded too. `ByteSlots` are tickets with a
fixed slot of bytes each: a family whose rows are encoded files (the GPU-decode path) has each
file's bytes written there by its prep process, and the engine reads them in place (a
memoryview), so they never cross a pipe; a file larger than its slot still travels with the
answer. They are lent, written and given back exactly as pixel slots are.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.app.core.errors import TransientError

log = logging.getLogger(__name__)

PREFIX = "kiln-"


def shm_dir() -> Path:
    """Where segments live: /dev/shm (memory) on Linux, else the temporary folder."""
    shm = Path("/dev/shm")  # noqa: S108 - POSIX shared memory, not a temporary file
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class SlotLayout:
    """One slot: an array of this shape and dtype (a model's input image, e.g. 224×224×3)."""

    shape: tuple[int, ...]
    dtype: str = "uint8"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class Segment:
    """A named shared-memory file mapped into this process, viewed as `count` slots. The
    creator keeps the file open and locked (`reclaim` leaves a locked segment alone)."""

    def __init__(self, path: Path, layout: SlotLayout, count: int, *, create: bool) -> None:
        self.path, self.layout, self.count = path, layout, count
        size = max(1, layout.nbytes * count)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        self._lock_fd: int | None = None
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _reserve(fd, size, path)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        if create:
            self._lock_fd = fd  # held (open and locked) until close
        else:
            os.close(fd)
        self.array: np.ndarray = np.ndarray((count, *layout.shape), layout.dtype, self._map)

    @property
    def name(self) -> str:
        return self.path.name

    def buffer(self) -> memoryview:
        """The whole segment as bytes: the map stays open while any slice of it lives."""
        return memoryview(self._map)

    def close(self) -> None:
        del self.array  # the view must go before the map can close
        # A view of its bytes may still be held (a batch being let go of): the mapping then
        # goes with the last view (the file is unlinked by its pool).
        with contextlib.suppress(BufferError):
            self._map.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _reserve(fd: int, size: int, path: Path) -> None:
    """Take the segment's pages now: on a full /dev/shm (a container's 64 MiB default) this
    says so with a sentence instead of a prep process dying of SIGBUS on its first write."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError as error:
        free = shutil.disk_usage(path.parent).free
        raise OSError(
            f"Kiln could not reserve {size / 2**20:.0f} MiB of shared memory in {path.parent} "
            f"({free / 2**20:.0f} MiB free): {error.strerror}. Give the worker a larger "
            "/dev/shm (compose: shm_size; Kubernetes: an emptyDir with medium Memory)."  # noqa: S108
        ) from None


def shm_free() -> int:
    """Bytes free where segments are made."""
    return shutil.disk_usage(shm_dir()).free


def attach(name: str, layout: SlotLayout, count: int) -> Segment:
    """A prep process's view of the pool named `name`."""
    if not name.startswith(PREFIX) or "/" in name:
        raise ValueError(f"{name!r} is not a Kiln slot segment.")
    return Segment(shm_dir() / name, layout, count, create=False)


class Lender:
    """`count` tickets (indices), lent in blocks; `acquire` waits while too few are free,
    which is what keeps prep from running ahead of the engine."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("A lender needs at least one ticket.")
        self.count = count
        self._free = np.arange(count, dtype=np.int32)  # a stack: [0, _top) are free
        self._top = count
        self._cond = threading.Condition()
        self._closed = False

    @property
    def free(self) -> int:
        with self._cond:
            return self._top

    def acquire(self, n: int, timeout: float | None = None) -> np.ndarray | None:
        """`n` slots (at most the pool's size), or None after `timeout` seconds."""
        if not 1 <= n <= self.count:
            raise ValueError(f"Cannot take {n} slots from a pool of {self.count}.")
        with self._cond:
            if not self._cond.wait_for(lambda: self._top >= n or self._closed, timeout):
                return None
            if self._closed:  # the model was unloaded or the worker stops: run the chunk again
                raise TransientError("The model's slots were released; the chunk runs again.")
            self._top -= n
            return self._free[self._top : self._top + n].copy()

    def release(self, slots: np.ndarray) -> None:
        if not len(slots):
            return
        with self._cond:
            end = self._top + len(slots)
            if end > self.count:
                raise RuntimeError("More slots released than were taken.")
            self._free[self._top : end] = slots
            self._top = end
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _segment_path(label: str) -> Path:
    """A new segment's file: the owner's pid, the model's name and a random token."""
    tag = "".join(c for c in label if c.isalnum())[:24]
    return shm_dir() / f"{PREFIX}{os.getpid()}-{tag}-{secrets.token_hex(4)}"


class SlotPool(Lender):
    """`count` slots of `layout` in one shared-memory segment, lent as `Lender` tickets: a
    ticket is a slot's index."""

    def __init__(self, layout: SlotLayout, count: int, label: str = "") -> None:
        super().__init__(count)
        self.segment = Segment(_segment_path(label), layout, count, create=True)
        self.layout = layout
        self.array = self.segment.array

    @property
    def name(self) -> str:
        return self.segment.name

    def gather(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The slots' contents as one contiguous batch (a copy: the slots may be reused), in
        `out` when given (a buffer of the batch's shape)."""
        if out is None:
            batch: np.ndarray = self.array[slots]  # fancy indexing: one copy, in C
            return batch
        return np.take(self.array, slots, axis=0, out=out)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
        super().close()
        del self.array
        self.segment.path.unlink(missing_ok=True)
        self.segment.close()


BYTE_SLOT = 256 * 2**10  # an encoded file's room: most photos fit; a larger one takes the pipe


class ByteSlots(Lender):
    """`count` tickets, each a slot of `size` bytes in one shared-memory segment: where a prep
    process writes a row's encoded file for the engine process, which reads it in place. Not a
    `SlotPool`: its rows are objects to the Batcher (no pixels are gathered from it)."""

    def __init__(self, count: int, size: int = BYTE_SLOT, label: str = "") -> None:
        super().__init__(count)
        self.size = size
        self.layout = SlotLayout((size,))  # what a prep process attaches
        self.segment = Segment(_segment_path(label), self.layout, count, create=True)
        # Views of the map itself (not of the array: NumPy holds no export on the map, which
        # would then unmap under a live view): while one is held, the map cannot close.
        self._bytes = self.segment.buffer()

    @property
    def name(self) -> str:
        return self.segment.name

    def view(self, slot: int, length: int) -> memoryview:
        """The first `length` bytes of `slot`, in place: valid until the slot is given back."""
        start = slot * self.size
        return self._bytes[start : start + length]

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
        super().close()
        self._bytes.release()
        self.segment.path.unlink(missing_ok=True)
        self.segment.close()


def reclaim(folder: Path | None = None) -> list[str]:
    """Unlink the segments whose owner is gone (killed before it could): those whose lock can
    be taken. Returns their names."""
    removed = []
    for path in (folder or shm_dir()).glob(f"{PREFIX}*"):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its owner lives and holds it
        else:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        finally:
            os.close(fd)
    if removed:
        log.info("reclaimed %d shared-memory segments of exited workers", len(removed))
    return removed
