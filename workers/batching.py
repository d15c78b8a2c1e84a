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

And two for a fleet that runs for weeks:
- `deadline_s`: a watchdog fails the rows of a batch that has run longer (a wedged GPU call, a
  deadlocked engine) with `BatchDeadlineError`, a transient error, starts a fresh runner in the
  stuck one's place and calls `on_wedged` (the worker then reports itself unhealthy).
- `oom_recovery_s`: a cap lowered by an out-of-memory batch doubles back, one step per quiet
  period, up to the configured `max_batch`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from opentelemetry.trace import SpanContext

from kiln.app.core.errors import TransientError
from kiln.app.observability.tracing import batch_span, current_span_context

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")

BatchFn = Callable[[Sequence[In]], Sequence[Out]]


class BatcherClosedError(TransientError):
    """Raised by `submit` after `close()`: the worker is shutting down or unloaded the model;
    the chunk runs again (here, once the model is loaded again, or on another worker)."""


class BatchDeadlineError(TransientError):
    """The row's batch ran past its deadline: the engine is stuck; another run may succeed."""


@dataclass
class _Running(Generic[In, Out]):
    """A batch a runner is executing, watched for its deadline."""

    batch: list[_Pending[In, Out]]
    started: float
    expired: bool = False


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
        deadline_s: float | None = None,
        on_wedged: Callable[[str | None], None] | None = None,
        oom_recovery_s: float | None = None,
    ) -> None:
        if max_batch < 1 or runners < 1 or max_delay_s < 0 or (max_queued or 1) < 1:
            raise ValueError("max_batch, runners and max_queued must be >= 1, max_delay_s >= 0.")
        self.fn = fn
        self.max_batch = max_batch
        self.cap = max_batch  # what an out-of-memory cut grows back to
        self.oom_recovery_s = oom_recovery_s
        self._last_oom: float | None = None
        self.deadline_s = deadline_s
        self._on_wedged = on_wedged  # called with a sentence when stuck, None when it recovers
        self._running: dict[int, _Running[In, Out]] = {}  # runner thread id → its batch
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
        self._runner_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        for _ in range(runners):
            self._start_runner()
        if deadline_s is not None:
            threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    def _start_runner(self) -> None:
        number = next(self._runner_ids)
        thread = threading.Thread(
            target=self._run, name=f"{self.name}-runner-{number}", daemon=True
        )
        self._threads.append(thread)
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
            if self._worth_waking():
                self._cond.notify_all()
        return future

    def _worth_waking(self) -> bool:
        """Whether a new row changes what a runner would do: the first row starts a runner's
        delay, a full batch is cut at once, and a greedy runner cuts when no announced row is
        still coming. Any other row waits for the cut (waking every runner per row costs more
        than the rows themselves on a busy host)."""
        queued = self._queued()
        return queued == 1 or queued >= self.max_batch or (self.greedy and self._announced <= 0)

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
        for thread in list(self._threads):
            thread.join(timeout)

    # --- runners -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            if batch and not self._execute(batch):
                return  # the watchdog gave up on this runner and started another

    def _gather(self) -> list[_Pending[In, Out]] | None:
        """Block for a first row, then take more until full, the delay has passed, or (greedy)
        no announced row is still coming. None once closed and drained."""
        with self._cond:
            while not self._rows and not self._urgent:
                if self._closed:
                    return None
                self._cond.wait()
            self._grow_after_quiet()
            first = self._urgent[0] if self._urgent else self._rows[0]
            deadline = first.enqueued + self.max_delay_s
            # Rows stay queued until the cut, so submitters need not wake this runner per row.
            while self._queued() < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or (self.greedy and self._announced <= 0):
                    break
                self._cond.wait(remaining)
                if not self._queued():  # another runner cut them meanwhile
                    return [] if not self._closed else None
            take = min(self.max_batch, self._queued())
            batch = [self._next_row() for _ in range(take)]
            self._cond.notify_all()  # room in the queue for blocked submitters
            return batch

    def _queued(self) -> int:
        return len(self._rows) + len(self._urgent)

    def _next_row(self) -> _Pending[In, Out]:
        return self._urgent.popleft() if self._urgent else self._rows.popleft()

    def _execute(self, batch: list[_Pending[In, Out]]) -> bool:
        """Run one batch; False when the watchdog expired it meanwhile (this runner retires)."""
        started = time.monotonic()
        batch_id = next(self._batch_ids)
        live = [p for p in batch if p.future.set_running_or_notify_cancel()]
        origins = [p.origin for p in batch]
        running = _Running(live, started)
        with self._stats_lock:
            self._running[threading.get_ident()] = running
        try:
            with batch_span(origins, batcher=self.name, batch_id=batch_id, batch_size=len(batch)):
                if live:
                    self._run_or_split(live)
        finally:
            with self._stats_lock:
                del self._running[threading.get_ident()]
                still_stuck = any(r.expired for r in self._running.values())
        if running.expired:
            log.warning("%s: a batch past its deadline returned after %.0f s", self.name,
                        time.monotonic() - started)  # fmt: skip
            if not still_stuck and self._on_wedged is not None:
                self._on_wedged(None)
            return False
        seconds = time.monotonic() - started
        self._record(batch, started, seconds)
        log.debug(
            "%s: batch %d of %d rows in %.1f ms", self.name, batch_id, len(batch), seconds * 1000,
            extra={"batcher": self.name, "batch_id": batch_id, "batch_size": len(batch)},
        )  # fmt: skip
        return True

    # --- the deadline watchdog -----------------------------------------------------------

    def _watch(self) -> None:
        assert self.deadline_s is not None
        interval = max(0.01, min(1.0, self.deadline_s / 4))
        while True:
            time.sleep(interval)
            with self._cond:
                if self._closed:
                    return
            self._expire(time.monotonic() - self.deadline_s)

    def _expire(self, started_before: float) -> None:
        """Fail the rows of every batch started before `started_before`, once, and put a fresh
        runner in each stuck one's place (the stuck thread cannot be interrupted)."""
        with self._stats_lock:
            stuck = [
                r for r in self._running.values() if not r.expired and r.started < started_before
            ]
            for running in stuck:
                running.expired = True
                self.stats.expired_batches += 1
        for running in stuck:
            sentence = (
                f"{self.name}: a batch of {len(running.batch)} has run for more than "
                f"{self.deadline_s:g} s; the engine looks stuck."
            )
            log.error(sentence, extra={"batcher": self.name, "batch_size": len(running.batch)})
            if self._on_wedged is not None:  # first: a caller woken below finds it reported
                self._on_wedged(sentence)
            self._start_runner()
            for pending in running.batch:
                _settle(pending.future, error=BatchDeadlineError(sentence))

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
                _settle(batch[0].future, error=error)
                return
            log.info(
                "%s: batch of %d failed (%s); splitting", self.name, len(batch), error,
                extra={"batcher": self.name, "batch_size": len(batch)},
            )  # fmt: skip
            self._split(batch)
            return
        for pending, output in zip(batch, outputs, strict=True):
            _settle(pending.future, result=output)

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
            self._last_oom = time.monotonic()
        with self._stats_lock:
            self.stats.out_of_memory += 1
        log.warning(
            "%s: a batch of %d ran out of memory (%s); max batch is now %d",
            self.name, failed_size, error, self.max_batch,
            extra={"batcher": self.name, "batch_size": failed_size},
        )  # fmt: skip

    def _grow_after_quiet(self) -> None:
        """Under `_cond`: after a quiet `oom_recovery_s` since the last out-of-memory batch, the
        cap doubles (one step per quiet period) back towards `cap` — memory a neighbour held may
        be free again, and a cap lowered forever costs throughput for the process's life."""
        if self._last_oom is None or self.oom_recovery_s is None or self.max_batch >= self.cap:
            return
        if time.monotonic() - self._last_oom < self.oom_recovery_s:
            return
        self.max_batch = min(self.cap, self.max_batch * 2)
        self._last_oom = time.monotonic()
        log.info("%s: no out-of-memory batch for %.0f s; max batch is now %d",
                 self.name, self.oom_recovery_s, self.max_batch)  # fmt: skip


def _settle(future: Future[Out], result: object = None, error: BaseException | None = None) -> None:
    """Resolve a row's future unless the watchdog already failed it."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]
    except InvalidStateError:
        pass  # expired past its deadline: the caller already has its error


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
