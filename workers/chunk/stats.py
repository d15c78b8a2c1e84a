"""Running totals of chunk runs per model: items by final status and seconds per stage.

Kept by the worker runtime, updated once per chunk (never per row), read by the metrics
collectors at scrape time.
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
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ChunkTotals] = {}

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

    def snapshot(self) -> dict[str, ChunkTotals]:
        with self._lock:
            return {
                model: ChunkTotals(t.chunks, t.cached, Counter(t.items), dict(t.seconds))
                for model, t in self._models.items()
            }
