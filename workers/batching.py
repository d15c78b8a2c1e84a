"""The Batcher: gathers rows from many callers into micro-batches for one engine.

Generic on purpose: it knows nothing of Celery, images or ONNX. Callers `submit` rows and
get one `Future` per row; runner threads block on a condition (no polling), release a batch at
`max_batch` rows or `max_delay_s` after its first row, and resolve each future. A batch that
raises is split in halves until the bad row is alone, so one bad input fails one row; a batch
that runs out of memory also lowers the batch cap, so the engine is not asked for it again.

Two refinements for a worker that serves both bulk and interactive jobs:
- `greedy=True`: callers announce the rows they are about to submit (`expect`), and a partial
  batch waits only while announced rows are still on their way — a lone interactive image
  runs at once instead of waiting out the delay, while a chunk being decoded still fills
  its batch.
- `max_queued`: `submit` blocks while that many rows wait, so decoding threads cannot run
  arbitrarily far ahead of the engine (memory stays bounded, the CPU goes to the engine).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from opentelemetry.trace import SpanContext

from kiln.app.core.errors import KilnError
from kiln.app.observability.tracing import batch_span, current_span_context

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

BatchFn = Callable[[Sequence[In]], Sequence[Out]]


class BatcherClosedError(KilnError):
    """Raised by `submit` after `close()`: the worker is shutting down or reloading the model."""


@dataclass
class _Pending(Generic[In, Out]):
    row: In
    future: Future[Out]
    enqueued: float = field(default_factory=time.monotonic)
    origin: SpanContext = field(default_factory=current_span_context)  # the submitter's span


@dataclass
class BatchStats:
    """Running totals, read by metrics and benchmarks."""

    batches: int = 0
    rows: int = 0
    failed_batches: int = 0
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


class Announcement(Generic[In, Out]):
    """Rows a caller said it will submit; `submit` through it counts them down."""

    def __init__(self, batcher: Batcher[In, Out], rows: int, urgent: bool = False) -> None:
        self._batcher = batcher
        self.remaining = rows
        self.urgent = urgent

    def submit(self, row: In) -> Future[Out]:
        return self._batcher._submit(row, self)

    def skip(self, rows: int = 1) -> None:
        """Rows that will not come after all (a bad input, a cached result)."""
        self._batcher._write_off(self, rows)


class Batcher(Generic[In, Out]):
    def __init__(
        self,
        fn: BatchFn[In, Out],
        *,
        max_batch: int,
        max_delay_s: float,
        runners: int = 1,
        name: str = "batcher",
        greedy: bool = False,
        max_queued: int | None = None,
    ) -> None:
        if max_batch < 1 or runners < 1 or max_delay_s < 0 or (max_queued or 1) < 1:
            raise ValueError("max_batch, runners and max_queued must be >= 1, max_delay_s >= 0.")
        self.fn = fn
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.name = name
        self.greedy = greedy
        self.max_queued = max_queued
        self.stats = BatchStats()
        self._rows: deque[_Pending[In, Out]] = deque()
        # Rows of interactive work: taken before any queued bulk row, never held back by a full
        # queue (bulk rows fill it), so one uploaded image is not stuck behind a bucket.
        self._urgent: deque[_Pending[In, Out]] = deque()
        self._announced = 0  # rows announced and not yet submitted
        self._cond = threading.Condition()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._batch_ids = itertools.count(1)  # for spans and log lines
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-runner-{i}", daemon=True)
            for i in range(runners)
        ]
        for thread in self._threads:
            thread.start()

    # --- callers -------------------------------------------------------------------------

    def submit(self, row: In) -> Future[Out]:
        return self._submit(row, None)

    def submit_many(self, rows: Sequence[In]) -> list[Future[Out]]:
        return [self.submit(row) for row in rows]

    @contextmanager
    def expect(self, rows: int, urgent: bool = False) -> Iterator[Announcement[In, Out]]:
        """Announce `rows` coming rows; rows not submitted by the end are written off.
        `urgent` rows go ahead of every queued row that is not."""
        announcement: Announcement[In, Out] = Announcement(self, rows, urgent)
        with self._cond:
            self._announced += rows
        try:
            yield announcement
        finally:
            self._write_off(announcement, announcement.remaining)

    def _write_off(self, announcement: Announcement[In, Out], rows: int) -> None:
        with self._cond:
            rows = min(rows, announcement.remaining)
            self._announced -= rows
            announcement.remaining -= rows
            self._cond.notify_all()  # a runner may be waiting for those rows

    def _submit(self, row: In, announcement: Announcement[In, Out] | None) -> Future[Out]:
        future: Future[Out] = Future()
        urgent = announcement is not None and announcement.urgent
        with self._cond:
            while (
                not urgent
                and not self._closed
                and self.max_queued is not None
                and len(self._rows) >= self.max_queued
            ):
                self._cond.wait()
            if self._closed:
                raise BatcherClosedError(f"{self.name} is closed.")
            (self._urgent if urgent else self._rows).append(_Pending(row, future))
            if announcement is not None and announcement.remaining > 0:
                announcement.remaining -= 1
                self._announced -= 1
            self._cond.notify_all()
        return future

    def snapshot(self) -> BatchStats:
        """A consistent copy of the running totals (runners keep updating the live one)."""
        with self._stats_lock:
            return replace(
                self.stats,
                size_counts=Counter(self.stats.size_counts),
                engine_counts=Counter(self.stats.engine_counts),
                wait_counts=Counter(self.stats.wait_counts),
            )

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the rows already queued, then stop the runners."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)

    # --- runners -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            self._execute(batch)

    def _gather(self) -> list[_Pending[In, Out]] | None:
        """Block for a first row, then take more until full, the delay has passed, or (greedy)
        no announced row is still coming. None once closed and drained."""
        with self._cond:
            while not self._rows and not self._urgent:
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._next_row()]
            deadline = batch[0].enqueued + self.max_delay_s
            while len(batch) < self.max_batch:
                if self._rows or self._urgent:
                    batch.append(self._next_row())
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or (self.greedy and self._announced <= 0):
                    break
                self._cond.wait(remaining)
            self._cond.notify_all()  # room in the queue for blocked submitters
            return batch

    def _next_row(self) -> _Pending[In, Out]:
        return self._urgent.popleft() if self._urgent else self._rows.popleft()

    def _execute(self, batch: list[_Pending[In, Out]]) -> None:
        started = time.monotonic()
        batch_id = next(self._batch_ids)
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        origins = [p.origin for p in batch]
        with batch_span(origins, batcher=self.name, batch_id=batch_id, batch_size=len(batch)):
            if live:
                self._run_or_split(live)
        seconds = time.monotonic() - started
        self._record(batch, started, seconds)
        log.debug(
            "%s: batch %d of %d rows in %.1f ms", self.name, batch_id, len(batch), seconds * 1000,
            extra={"batcher": self.name, "batch_id": batch_id, "batch_size": len(batch)},
        )  # fmt: skip

    def _record(self, batch: list[_Pending[In, Out]], started: float, seconds: float) -> None:
        with self._stats_lock:  # runners share the totals
            self.stats.batches += 1
            self.stats.rows += len(batch)
            self.stats.size_counts[len(batch)] += 1
            self.stats.engine_seconds += seconds
            self.stats.queue_wait_seconds += sum(started - p.enqueued for p in batch)
            self.stats.engine_counts[seconds_bound(seconds)] += 1
            self.stats.wait_counts.update(seconds_bound(started - p.enqueued) for p in batch)

    def _run_or_split(self, batch: list[_Pending[In, Out]]) -> None:
        if len(batch) > self.max_batch:  # the cap shrank after an out-of-memory: don't retry
            self._split(batch)
            return
        try:
            outputs = self.fn([p.row for p in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(
                    f"{self.name}: the batch function returned {len(outputs)} results "
                    f"for {len(batch)} rows."
                )
        except Exception as error:
            with self._stats_lock:
                self.stats.failed_batches += 1
            if is_out_of_memory(error):
                self._shrink(len(batch), error)
            if len(batch) == 1:
                batch[0].future.set_exception(error)
                return
            log.info(
                "%s: batch of %d failed (%s); splitting", self.name, len(batch), error,
                extra={"batcher": self.name, "batch_size": len(batch)},
            )  # fmt: skip
            self._split(batch)
            return
        for pending, output in zip(batch, outputs, strict=True):
            pending.future.set_result(output)

    def _split(self, batch: list[_Pending[In, Out]]) -> None:
        middle = len(batch) // 2
        self._run_or_split(batch[:middle])
        self._run_or_split(batch[middle:])

    def _shrink(self, failed_size: int, error: Exception) -> None:
        """A batch ran out of memory: later batches stay below its size (never below 1), so
        the engine is not asked again for what it cannot hold."""
        with self._cond:
            if failed_size <= self.max_batch:
                self.max_batch = max(1, failed_size // 2)
        with self._stats_lock:
            self.stats.out_of_memory += 1
        log.warning(
            "%s: a batch of %d ran out of memory (%s); max batch is now %d",
            self.name, failed_size, error, self.max_batch,
            extra={"batcher": self.name, "batch_size": failed_size},
        )  # fmt: skip


SECONDS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def seconds_bound(seconds: float) -> float:
    """The smallest of SECONDS_BOUNDS that holds `seconds` (inf beyond the last)."""
    index = bisect.bisect_left(SECONDS_BOUNDS, seconds)
    return SECONDS_BOUNDS[index] if index < len(SECONDS_BOUNDS) else float("inf")


_OOM_WORDS = ("out of memory", "failed to allocate memory", "cudaerrormemoryallocation")


def is_out_of_memory(error: BaseException) -> bool:
    """MemoryError, CuPy's OutOfMemoryError, or an engine's allocation failure by its message
    (ONNX Runtime and TensorRT report it as a generic runtime error)."""
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":
        return True
    text = str(error).lower()
    return any(word in text for word in _OOM_WORDS)
