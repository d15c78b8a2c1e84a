"""Out of memory: telling it from other failures, and the live batch cap it lowers.

A batch that runs out of memory halves the cap below its size, so the engine is not asked
again for what it cannot hold; after a quiet `oom_recovery_s` the cap doubles back, one step
per quiet period, up to the configured `max_batch` — memory a neighbour held may be free
again, and a cap lowered forever costs throughput for the process's life.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger(__name__)

_OOM_WORDS = ("out of memory", "failed to allocate memory", "cudaerrormemoryallocation")


def is_out_of_memory(error: BaseException) -> bool:
    """MemoryError, CuPy's OutOfMemoryError, or an engine's allocation failure by its message
    (ONNX Runtime and TensorRT report it as a generic runtime error)."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    return any(word in text for word in _OOM_WORDS)


class BatchCap:
    """The most rows a batch may hold now: `ceiling` (the configured `max_batch`) until a
    batch runs out of memory."""

    def __init__(self, name: str, ceiling: int, recovery_s: float | None) -> None:
        self.name = name  # the Batcher's, for log lines
        self.ceiling = ceiling
        self.rows = ceiling
        self.recovery_s = recovery_s
        self._last_oom: float | None = None
        self._lock = threading.Lock()

    def shrink(self, failed_size: int, error: Exception) -> None:
        """A batch of `failed_size` ran out of memory: later batches stay below it (never
        below 1)."""
        with self._lock:
            if failed_size <= self.rows:
                self.rows = max(1, failed_size // 2)
            self._last_oom = time.monotonic()
        log.warning(
            "%s: a batch of %d ran out of memory (%s); max batch is now %d",
            self.name, failed_size, error, self.rows,
            extra={"batcher": self.name, "batch_size": failed_size},
        )  # fmt: skip

    def grow_after_quiet(self) -> None:
        """Double the cap (towards `ceiling`) if no batch ran out of memory for `recovery_s`."""
        with self._lock:
            if self._last_oom is None or self.recovery_s is None or self.rows >= self.ceiling:
                return
            if time.monotonic() - self._last_oom < self.recovery_s:
                return
            self.rows = min(self.ceiling, self.rows * 2)
            self._last_oom = time.monotonic()
        log.info("%s: no out-of-memory batch for %.0f s; max batch is now %d",
                 self.name, self.recovery_s, self.rows)  # fmt: skip
