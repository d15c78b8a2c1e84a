"""A Batcher's running totals: counted by its runners and watchdog, read by metrics and
benchmarks as consistent copies."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.workers.batching.blocks import Taken

SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def seconds_bound(seconds: float) -> float:
    """The smallest of SECONDS_BOUNDS that holds `seconds` (inf beyond the last)."""
    index = bisect.bisect_left(SECONDS_BOUNDS, seconds)
    return SECONDS_BOUNDS[index] if index < len(SECONDS_BOUNDS) else float("inf")


@dataclass
class BatchStats:
    """Running totals, read by metrics and benchmarks."""

    batches: int = 0
    rows: int = 0
    failed_batches: int = 0
    expired_batches: int = 0  # batches failed by the deadline watchdog (the engine was stuck)
    out_of_memory: int = 0  # batches that ran out of device or host memory (the cap shrank)
    engine_seconds: float = 0.0
    queue_wait_seconds: float = 0.0
    size_counts: Counter[int] = field(default_factory=Counter)
    # Histogram counts keyed by bucket upper bound (one of SECONDS_BOUNDS, or inf)
    engine_counts: Counter[float] = field(default_factory=Counter)  # engine time, per batch
    wait_counts: Counter[float] = field(default_factory=Counter)  # queue wait, per row

    @property
    def mean_batch(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


class Tally:
    """The live `BatchStats` and the lock its counters are bumped under (runners share them)."""

    def __init__(self) -> None:
        self.stats = BatchStats()
        self._lock = threading.Lock()

    def batch(self, batch: Sequence[Taken[Any, Any]], started: float, seconds: float) -> None:
        """A batch that ran for `seconds` from `started`: its size, engine time and each row's
        wait in the queue."""
        rows = sum(len(taken) for taken in batch)
        with self._lock:
            stats = self.stats
            stats.batches += 1
            stats.rows += rows
            stats.size_counts[rows] += 1
            stats.engine_seconds += seconds
            stats.engine_counts[seconds_bound(seconds)] += 1
            for taken in batch:
                wait = started - taken.queued.enqueued
                stats.queue_wait_seconds += wait * len(taken)
                stats.wait_counts[seconds_bound(wait)] += len(taken)  # a row's wait

    def failed(self) -> None:
        with self._lock:
            self.stats.failed_batches += 1

    def expired(self) -> None:
        with self._lock:
            self.stats.expired_batches += 1

    def out_of_memory(self) -> None:
        with self._lock:
            self.stats.out_of_memory += 1

    def snapshot(self) -> BatchStats:
        """A consistent copy of the running totals (runners keep updating the live one)."""
        with self._lock:
            return replace(
                self.stats,
                size_counts=Counter(self.stats.size_counts),
                engine_counts=Counter(self.stats.engine_counts),
                wait_counts=Counter(self.stats.wait_counts),
            )
