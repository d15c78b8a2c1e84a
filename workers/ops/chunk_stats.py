"""Running totals of chunk runs per model: items by final status and seconds per stage.

Kept by the worker runtime, updated once per chunk (never per row), read by the metrics
collectors at scrape time: a process's counters, so they live in ops/ beside the metrics that
read them (one chunk's own report is `workers/chunk/stats.py`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

STAGES = ("fetch", "decode", "infer", "write")  # the order a chunk runs them in


@dataclass
class ChunkTotals:
    chunks: int = 0
    cached: int = 0  # items answered from the content cache
    items: Counter[str] = field(default_factory=Counter)  # by final status
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


class ChunkStats:
    """Per model, the items by final status and the seconds per stage of the chunks this
    process finished (for its metrics); and a count of them that `kiln run` waits on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ChunkTotals] = {}
        self._finished = threading.Condition(self._lock)
        self._chunks = 0

    def record(
        self,
        model: str,
        statuses: Mapping[str, int],
        seconds: Mapping[str, float],
        cached: int = 0,
    ) -> None:
        with self._lock:
            totals = self._models.setdefault(model, ChunkTotals())
            totals.chunks += 1
            totals.cached += cached
            totals.items.update(statuses)
            for stage, spent in seconds.items():
                totals.seconds[stage] = totals.seconds.get(stage, 0.0) + spent
            self._chunks += 1
            self._finished.notify_all()

    def wait(self, seen: int, timeout: float) -> int:
        """Wait until a chunk finishes after the `seen`-th (or `timeout` passes); returns how
        many have finished in this process."""
        with self._finished:
            self._finished.wait_for(lambda: self._chunks != seen, timeout)
            return self._chunks

    def snapshot(self) -> dict[str, ChunkTotals]:
        with self._lock:
            return {
                model: ChunkTotals(t.chunks, t.cached, Counter(t.items), dict(t.seconds))
                for model, t in self._models.items()
            }
