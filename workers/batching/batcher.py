"""The Batcher: gathers blocks of rows from many callers into micro-batches for one engine.

Generic on purpose: it knows nothing of Celery, images or ONNX. Callers `submit` a *block* (a
unit's rows: slots of decoded images, token ids, strips) and get one `Future` per block; runner
threads block on a condition (no polling), cut a batch at `max_batch` rows — from as many
blocks as it takes, splitting a block across batches — or `max_delay_s` after its first row,
and run the batch function over the `Part`s (rows [start, stop) of a block) it took. Its result
is cut back into parts and joined per block by a `Shape` (how this batcher's results are cut,
joined and failed), so no row ever needs a future or an object of its own. A batch that raises
is split in halves until the bad row is alone, so one bad input fails one row; a batch that
runs out of memory also lowers the batch cap, so the engine is not asked for it again.

Two refinements for a worker that serves both bulk and interactive jobs:
- `greedy=True`: callers announce the rows they are about to submit (`expect`), and a partial
  batch waits only while announced rows are still on their way — a lone interactive image
  runs at once instead of waiting out the delay, while a chunk being decoded still fills
  its batch.
- `max_queued`: `submit` blocks while that many rows wait, so callers cannot run arbitrarily
  far ahead of the engine (memory stays bounded, the CPU goes to the engine).

- `Announcement.withdraw`: a caller whose job was cancelled takes back its rows that no batch
  has taken yet (their blocks answer with the withdrawn rows failed), and `submit` given a
  `give_up` test stops waiting for room in a full queue once it is true.

And two for a fleet that runs for weeks:
- `deadline_s`: a watchdog fails the blocks of a batch that has run longer (a wedged GPU call,
  a deadlocked engine) with `BatchDeadlineError`, a transient error, starts a fresh runner in
  the stuck one's place and calls `on_wedged` (the worker then reports itself unhealthy).
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
from collections.abc import Callable, Iterator, Sequence, Sized
from concurrent.futures import Future, InvalidStateError
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry.trace import SpanContext

from kiln.app.core.errors import TransientError
from kiln.app.observability.tracing import batch_span, current_span_context

log = logging.getLogger(__name__)

GIVE_UP_POLL_S = 0.25  # how often a submitter waiting for room asks whether to give up

B = TypeVar("B", bound=Sized)  # a block of rows
R = TypeVar("R", bound=Sized)  # what the batch function answers for its rows (one per row)


class BatcherClosedError(TransientError):
    """Raised by `submit` after `close()`: the worker is shutting down or unloaded the model;
    the chunk runs again (here, once the model is loaded again, or on another worker)."""


class BatchDeadlineError(TransientError):
    """The block's batch ran past its deadline: the engine is stuck; another run may succeed."""


class Shape(Protocol[R]):
    """How a batcher's results are cut into parts, joined into a block's, and made for rows
    that failed (an error that is not transient fails its rows, not the block)."""

    def cut(self, result: R, start: int, stop: int) -> R: ...

    def join(self, parts: Sequence[R]) -> R: ...

    def failed(self, rows: int, error: Exception) -> R: ...


class ListShape:
    """Results as one list entry per row; a failed row holds its exception."""

    def cut(self, result: list[Any], start: int, stop: int) -> list[Any]:
        return result[start:stop]

    def join(self, parts: Sequence[list[Any]]) -> list[Any]:
        return [row for part in parts for row in part]

    def failed(self, rows: int, error: Exception) -> list[Any]:
        return [error] * rows


@dataclass(frozen=True)
class Part(Generic[B]):
    """Rows [start, stop) of a block: what batches are made of."""

    block: B
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


BatchFn = Callable[[Sequence[Part[B]]], R]


class _Queued(Generic[B, R]):
    """A submitted block: its rows not yet cut into a batch, and its parts' results."""

    def __init__(self, block: B, urgent: bool) -> None:
        self.block = block
        self.rows = len(block)
        self.urgent = urgent
        self.future: Future[R] = Future()
        self.cut = 0  # rows already taken into batches
        self.remaining = self.rows  # rows without a result yet
        self.parts: dict[int, R] = {}  # by start row
        self.enqueued = time.monotonic()
        self.origin: SpanContext = current_span_context()  # the submitter's span
        self.lock = threading.Lock()


@dataclass
class _Taken(Generic[B, R]):
    queued: _Queued[B, R]
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass
class _Running(Generic[B, R]):
    """A batch a runner is executing, watched for its deadline."""

    batch: list[_Taken[B, R]]
    started: float
    expired: bool = False


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


class WithdrawnError(Exception):
    """The answer of rows their caller took back before any batch took them (a cancel)."""


class Announcement(Generic[B, R]):
    """Rows a caller said it will submit; `submit` through it counts them down."""

    def __init__(self, batcher: Batcher[B, R], rows: int, urgent: bool = False) -> None:
        self._batcher = batcher
        self.remaining = rows
        self.urgent = urgent
        self._queued: list[_Queued[B, R]] = []  # its blocks, for `withdraw`

    def submit(self, block: B) -> Future[R]:
        future = self.submit_unless(block, None)
        assert future is not None  # nothing to give up on
        return future

    def submit_unless(self, block: B, give_up: Callable[[], bool] | None) -> Future[R] | None:
        """The block's future; None when `give_up` became true while the queue was full (the
        block was not queued)."""
        queued = self._batcher._submit(block, self, give_up)
        if queued is None:
            return None
        self._queued = [q for q in self._queued if not q.future.done()]
        self._queued.append(queued)
        return queued.future

    def skip(self, rows: int = 1) -> None:
        """Rows that will not come after all (a bad input, a cached result)."""
        self._batcher._write_off(self, rows)

    def withdraw(self) -> dict[Future[R], int]:
        """Take back every row of this caller's blocks that no batch has taken yet. Returns,
        per block that lost rows, the first row withdrawn (rows from there to the block's end);
        each such block still answers, its withdrawn rows failed with `WithdrawnError`, once
        its rows already in a batch are answered."""
        return self._batcher._withdraw(self._queued)


class Batcher(Generic[B, R]):
    def __init__(
        self,
        fn: BatchFn[B, R],
        shape: Shape[R],
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
        if (
            max_batch < 1
            or runners < 1
            or max_delay_s < 0
            or (max_queued is not None and max_queued < 1)
        ):
            raise ValueError("max_batch, runners and max_queued must be >= 1, max_delay_s >= 0.")
        self.fn = fn
        self.shape = shape
        self.max_batch = max_batch
        self.cap = max_batch  # what an out-of-memory cut grows back to
        self.oom_recovery_s = oom_recovery_s
        self._last_oom: float | None = None
        self.deadline_s = deadline_s
        self._on_wedged = on_wedged  # called with a sentence when stuck, None when it recovers
        self._running: dict[int, _Running[B, R]] = {}  # runner thread id → its batch
        self.max_delay_s = max_delay_s
        self.name = name
        self.greedy = greedy
        self.max_queued = max_queued
        self.stats = BatchStats()
        self._blocks: deque[_Queued[B, R]] = deque()
        # Blocks of interactive work: taken before any queued bulk row, never held back by a
        # full queue (bulk rows fill it), so one uploaded image is not stuck behind a bucket.
        self._urgent: deque[_Queued[B, R]] = deque()
        self._rows = 0  # rows queued and not yet cut into a batch, both queues
        self._bulk_rows = 0
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

    def submit(self, block: B) -> Future[R]:
        queued = self._submit(block, None, None)
        assert queued is not None  # nothing to give up on
        return queued.future

    @contextmanager
    def expect(self, rows: int, urgent: bool = False) -> Iterator[Announcement[B, R]]:
        """Announce `rows` coming rows; rows not submitted by the end are written off.
        `urgent` rows go ahead of every queued row that is not."""
        announcement: Announcement[B, R] = Announcement(self, rows, urgent)
        with self._cond:
            self._announced += rows
        try:
            yield announcement
        finally:
            self._write_off(announcement, announcement.remaining)

    def _write_off(self, announcement: Announcement[B, R], rows: int) -> None:
        with self._cond:
            rows = min(rows, announcement.remaining)
            self._announced -= rows
            announcement.remaining -= rows
            self._cond.notify_all()  # a runner may be waiting for those rows

    def _submit(
        self,
        block: B,
        announcement: Announcement[B, R] | None,
        give_up: Callable[[], bool] | None,
    ) -> _Queued[B, R] | None:
        urgent = announcement is not None and announcement.urgent
        queued: _Queued[B, R] = _Queued(block, urgent)
        if not queued.rows:
            queued.future.set_result(self.shape.join([]))
            return queued
        with self._cond:
            while (
                not urgent
                and not self._closed
                and self.max_queued is not None
                and self._bulk_rows >= self.max_queued
            ):
                if give_up is not None and give_up():
                    return None
                # With a give_up test, look at it now and then: nothing notifies a cancel.
                self._cond.wait(None if give_up is None else GIVE_UP_POLL_S)
            if self._closed:
                raise BatcherClosedError(f"{self.name} is closed.")
            (self._urgent if urgent else self._blocks).append(queued)
            before = self._rows
            self._rows += queued.rows
            if not urgent:
                self._bulk_rows += queued.rows
            if announcement is not None:
                counted = min(queued.rows, announcement.remaining)
                announcement.remaining -= counted
                self._announced -= counted
            if self._worth_waking(before):
                self._cond.notify_all()
        return queued

    def _withdraw(self, blocks: Sequence[_Queued[B, R]]) -> dict[Future[R], int]:
        """Remove the uncut rows of `blocks` from the queues; answer them as withdrawn."""
        withdrawn: list[tuple[_Queued[B, R], int]] = []
        with self._cond:
            for queued in blocks:
                left = queued.rows - queued.cut
                queue = self._urgent if queued.urgent else self._blocks
                if not left or queued.future.done() or queued not in queue:
                    continue
                queue.remove(queued)
                withdrawn.append((queued, queued.cut))
                queued.cut = queued.rows
                self._rows -= left
                if not queued.urgent:
                    self._bulk_rows -= left
            self._cond.notify_all()  # room in the queue for blocked submitters
        for queued, start in withdrawn:
            error = WithdrawnError("The job was cancelled.")
            self._answered(
                _Taken(queued, start, queued.rows), self.shape.failed(queued.rows - start, error)
            )
        return {queued.future: start for queued, start in withdrawn}

    def _worth_waking(self, before: int) -> bool:
        """Whether a new block changes what a runner would do: the first rows start a runner's
        delay, a full batch is cut at once, and a greedy runner cuts when no announced row is
        still coming. Any other block waits for the cut."""
        return before == 0 or self._rows >= self.max_batch or (self.greedy and self._announced <= 0)

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

    def _gather(self) -> list[_Taken[B, R]] | None:
        """Block for a first row, then wait for more until full, the delay has passed, or
        (greedy) no announced row is still coming. None once closed and drained."""
        with self._cond:
            while not self._rows:
                if self._closed:
                    return None
                self._cond.wait()
            self._grow_after_quiet()
            first = self._urgent[0] if self._urgent else self._blocks[0]
            deadline = first.enqueued + self.max_delay_s
            # Rows stay queued until the cut, so submitters need not wake this runner per block.
            while self._rows < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed or (self.greedy and self._announced <= 0):
                    break
                self._cond.wait(remaining)
                if not self._rows:  # another runner cut them meanwhile
                    return [] if not self._closed else None
            batch = self._take(min(self.max_batch, self._rows))
            self._cond.notify_all()  # room in the queue for blocked submitters
            return batch

    def _take(self, rows: int) -> list[_Taken[B, R]]:
        """Under `_cond`: `rows` rows from the head blocks, urgent first; a block may be split."""
        batch: list[_Taken[B, R]] = []
        while rows:
            queue = self._urgent if self._urgent else self._blocks
            queued = queue[0]
            take = min(rows, queued.rows - queued.cut)
            batch.append(_Taken(queued, queued.cut, queued.cut + take))
            queued.cut += take
            rows -= take
            self._rows -= take
            if not queued.urgent:
                self._bulk_rows -= take
            if queued.cut == queued.rows:
                queue.popleft()
        return batch

    def _execute(self, batch: list[_Taken[B, R]]) -> bool:
        """Run one batch; False when the watchdog expired it meanwhile (this runner retires)."""
        started = time.monotonic()
        batch_id = next(self._batch_ids)
        live = [t for t in batch if not t.queued.future.done()]  # an expired block is over
        rows = sum(len(t) for t in batch)
        running = _Running(live, started)
        with self._stats_lock:
            self._running[threading.get_ident()] = running
        try:
            origins = [t.queued.origin for t in batch]
            with batch_span(origins, batcher=self.name, batch_id=batch_id, batch_size=rows):
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
        self._record(batch, rows, started, seconds)
        log.debug(
            "%s: batch %d of %d rows in %.1f ms", self.name, batch_id, rows, seconds * 1000,
            extra={"batcher": self.name, "batch_id": batch_id, "batch_size": rows},
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
        """Fail the blocks of every batch started before `started_before`, once, and put a
        fresh runner in each stuck one's place (the stuck thread cannot be interrupted)."""
        with self._stats_lock:
            stuck = [
                r for r in self._running.values() if not r.expired and r.started < started_before
            ]
            for running in stuck:
                running.expired = True
                self.stats.expired_batches += 1
        for running in stuck:
            rows = sum(len(t) for t in running.batch)
            sentence = (
                f"{self.name}: a batch of {rows} has run for more than "
                f"{self.deadline_s:g} s; the engine looks stuck."
            )
            log.error(sentence, extra={"batcher": self.name, "batch_size": rows})
            if self._on_wedged is not None:  # first: a caller woken below finds it reported
                self._on_wedged(sentence)
            for taken in running.batch:  # before a new runner could take their later rows
                _settle(taken.queued.future, error=BatchDeadlineError(sentence))
            self._start_runner()

    def _record(self, batch: list[_Taken[B, R]], rows: int, started: float, seconds: float) -> None:
        with self._stats_lock:  # runners share the totals
            self.stats.batches += 1
            self.stats.rows += rows
            self.stats.size_counts[rows] += 1
            self.stats.engine_seconds += seconds
            self.stats.engine_counts[seconds_bound(seconds)] += 1
            for taken in batch:
                wait = started - taken.queued.enqueued
                self.stats.queue_wait_seconds += wait * len(taken)
                self.stats.wait_counts[seconds_bound(wait)] += len(taken)  # a row's wait

    def _run_or_split(self, batch: list[_Taken[B, R]]) -> None:
        rows = sum(len(t) for t in batch)
        if rows > self.max_batch:  # the cap shrank after an out-of-memory: don't retry
            self._split(batch, rows)
            return
        try:
            result = self.fn([Part(t.queued.block, t.start, t.stop) for t in batch])
            if len(result) != rows:
                raise RuntimeError(
                    f"{self.name}: the batch function returned {len(result)} results "
                    f"for {rows} rows."
                )
        except Exception as error:
            with self._stats_lock:
                self.stats.failed_batches += 1
            if is_out_of_memory(error):
                self._shrink(rows, error)
            if rows == 1:
                self._fail(batch[0], error)
                return
            log.info(
                "%s: batch of %d failed (%s); splitting", self.name, rows, error,
                extra={"batcher": self.name, "batch_size": rows},
            )  # fmt: skip
            self._split(batch, rows)
            return
        offset = 0
        for taken in batch:
            self._answered(taken, self.shape.cut(result, offset, offset + len(taken)))
            offset += len(taken)

    def _split(self, batch: list[_Taken[B, R]], rows: int) -> None:
        middle, left, right = rows // 2, [], []
        for taken in batch:
            if middle >= len(taken):
                left.append(taken)
            elif middle <= 0:
                right.append(taken)
            else:  # the part that straddles the middle
                cut = taken.start + middle
                left.append(_Taken(taken.queued, taken.start, cut))
                right.append(_Taken(taken.queued, cut, taken.stop))
            middle -= len(taken)
        self._run_or_split(left)
        self._run_or_split(right)

    def _fail(self, taken: _Taken[B, R], error: Exception) -> None:
        """A row that fails alone: a transient error fails its whole block (the chunk runs
        again); any other is that row's answer."""
        if isinstance(error, TransientError):
            _settle(taken.queued.future, error=error)
        else:
            self._answered(taken, self.shape.failed(len(taken), error))

    def _answered(self, taken: _Taken[B, R], result: R) -> None:
        queued = taken.queued
        with queued.lock:
            queued.parts[taken.start] = result
            queued.remaining -= len(taken)
            if queued.remaining:
                return
            parts = [queued.parts[start] for start in sorted(queued.parts)]
        _settle(queued.future, result=self.shape.join(parts))

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


def _settle(future: Future[Any], result: object = None, error: BaseException | None = None) -> None:
    """Resolve a block's future unless it is settled already (the watchdog failed it, or a
    transient failure of one of its parts did)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
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
