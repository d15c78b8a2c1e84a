"""Which prep process decodes a run of video frames: a chunk's frame units all go to the one
that took its first, in order, so its reader decodes on from where the last unit stopped.

A process keeps readers for FRAME_RUNS stretches at once; one given more would decode GOPs
twice, so a run waits until a process has room. The pool builds its scheduler (a chunk reaches
it as `Preparer.frames`), which knows of the pool only what `loads` says: its live processes and
the units each holds.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping

# Runs of video frames one prep process decodes at once (each keeps a reader of its own).
FRAME_RUNS = 2
ANY = -1  # any process will do: prep runs on the chunk's thread


class FrameScheduler:
    """Claims of prep processes for runs of video frames. `loads`: the pool's live processes
    by id, each with the units it holds, in the pool's order (none: prep runs inline)."""

    def __init__(self, loads: Callable[[], Mapping[int, int]]) -> None:
        self._loads = loads
        self._runs: collections.Counter[int] = collections.Counter()  # process → runs
        self._free = threading.Condition()  # guards `_runs`; notified when a run ends
        self._closed = False

    def claim(self, timeout: float = 0) -> int | None:
        """A process for a run of video frames (all its units go there, in order): the one
        decoding the fewest such runs (then holding the fewest units), while one decodes fewer
        than FRAME_RUNS; None if none came free within `timeout` (or the pool closed). ANY: no
        processes."""
        deadline = time.monotonic() + timeout
        with self._free:
            while True:
                loads = self._loads()
                if not loads:
                    return ANY
                free = [p for p in loads if self._runs[p] < FRAME_RUNS]
                if free:
                    chosen = min(free, key=lambda p: (self._runs[p], loads[p]))
                    self._runs[chosen] += 1
                    return chosen
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return None
                self._free.wait(left)

    def release(self, process: int) -> None:
        """A run of video frames is done with `process`."""
        if process == ANY:
            return
        with self._free:
            self._runs[process] = max(0, self._runs[process] - 1)
            self._free.notify_all()

    def close(self) -> None:
        """The pool is closing: a claim waiting for room gives up now."""
        with self._free:
            self._closed = True
            self._free.notify_all()
