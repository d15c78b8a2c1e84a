"""The Batcher: gathers rows from many callers into micro-batches for one engine.

Generic on purpose: it knows nothing of Celery, images or ONNX. Callers `submit` rows and
get one `Future` per row; runner threads block on a queue (no polling), release a batch at
`max_batch` rows or `max_delay_s` after its first row, and resolve each future. A batch that
raises is split in halves until the bad row is alone, so one bad input fails one row.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

BatchFn = Callable[[Sequence[In]], Sequence[Out]]


class BatcherClosedError(RuntimeError):
    """Raised by `submit` after `close()`."""


@dataclass
class _Pending(Generic[In, Out]):
    row: In
    future: Future[Out]
    enqueued: float = field(default_factory=time.monotonic)


@dataclass
class BatchStats:
    """Running totals, read by metrics and benchmarks."""

    batches: int = 0
    rows: int = 0
    failed_batches: int = 0
    engine_seconds: float = 0.0
    queue_wait_seconds: float = 0.0
    size_counts: Counter[int] = field(default_factory=Counter)

    @property
    def mean_batch(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


_STOP = object()


class Batcher(Generic[In, Out]):
    def __init__(
        self,
        fn: BatchFn[In, Out],
        *,
        max_batch: int,
        max_delay_s: float,
        runners: int = 1,
        name: str = "batcher",
    ) -> None:
        if max_batch < 1 or runners < 1 or max_delay_s < 0:
            raise ValueError("max_batch and runners must be >= 1 and max_delay_s >= 0.")
        self.fn = fn
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self.name = name
        self.stats = BatchStats()
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-runner-{i}", daemon=True)
            for i in range(runners)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, row: In) -> Future[Out]:
        future: Future[Out] = Future()
        with self._lock:
            if self._closed:
                raise BatcherClosedError(f"{self.name} is closed.")
            self._queue.put(_Pending(row, future))
        return future

    def submit_many(self, rows: Sequence[In]) -> list[Future[Out]]:
        return [self.submit(row) for row in rows]

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the rows already queued, then stop the runners."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._queue.put(_STOP)
        for thread in self._threads:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch, stop = self._gather()
            if batch:
                self._execute(batch)
            if stop:
                return

    def _gather(self) -> tuple[list[_Pending[In, Out]], bool]:
        """Block for a first row, then take more until full or the delay has passed."""
        first = self._queue.get()
        if first is _STOP:
            return [], True
        assert isinstance(first, _Pending)
        batch: list[_Pending[In, Out]] = [first]
        deadline = first.enqueued + self.max_delay_s
        while len(batch) < self.max_batch:
            remaining = deadline - time.monotonic()
            try:
                entry = (
                    self._queue.get(timeout=remaining)
                    if remaining > 0
                    else self._queue.get_nowait()
                )
            except queue.Empty:
                break
            if entry is _STOP:
                return batch, True
            assert isinstance(entry, _Pending)
            batch.append(entry)
        return batch, False

    def _execute(self, batch: list[_Pending[In, Out]]) -> None:
        started = time.monotonic()
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        if live:
            self._run_or_split(live)
        self._record(batch, started, time.monotonic() - started)

    def _record(self, batch: list[_Pending[In, Out]], started: float, seconds: float) -> None:
        with self._lock:  # runners share the totals
            self.stats.batches += 1
            self.stats.rows += len(batch)
            self.stats.size_counts[len(batch)] += 1
            self.stats.engine_seconds += seconds
            self.stats.queue_wait_seconds += sum(started - p.enqueued for p in batch)

    def _run_or_split(self, batch: list[_Pending[In, Out]]) -> None:
        try:
            outputs = self.fn([p.row for p in batch])
            if len(outputs) != len(batch):
                raise RuntimeError(
                    f"{self.name}: the batch function returned {len(outputs)} results "
                    f"for {len(batch)} rows."
                )
        except Exception as error:
            with self._lock:
                self.stats.failed_batches += 1
            if len(batch) == 1:
                batch[0].future.set_exception(error)
                return
            log.info("%s: batch of %d failed (%s); splitting", self.name, len(batch), error)
            middle = len(batch) // 2
            self._run_or_split(batch[:middle])
            self._run_or_split(batch[middle:])
            return
        for pending, output in zip(batch, outputs, strict=True):
            pending.future.set_result(output)
