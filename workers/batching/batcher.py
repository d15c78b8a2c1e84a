"""The Batcher: runner threads that cut micro-batches from many callers' blocks and run one
batch function over them, each block answered through its own future.

A batch is cut from the `Intake` (full at the cap, or after the delay) and run over the
`Part`s it took; its result is cut back into parts and joined per block by a `Shape`. A batch
that raises is split in halves until the bad row is alone, so one bad input fails one row;
a batch that runs out of memory also lowers the cap (`BatchCap`), so the engine is not asked
for it again; a batch past its deadline is failed by the `Watchdog`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Generic

from kiln.app.core.errors import TransientError
from kiln.app.observability.tracing import batch_span
from kiln.workers.batching.blocks import B, BatchFn, Part, R, Shape, Taken, answer, settle
from kiln.workers.batching.intake import Announcement, Intake
from kiln.workers.batching.oom import BatchCap, is_out_of_memory
from kiln.workers.batching.policy import BatchPolicy
from kiln.workers.batching.stats import BatchStats, Tally
from kiln.workers.batching.watchdog import Watchdog, Wedged

log = logging.getLogger(__name__)


class Batcher(Generic[B, R]):
    """`fn` run over batches of the blocks callers submit, by `policy.runners` threads.

    `name` names its threads, log lines and spans; `on_wedged` hears of a batch stuck past
    the policy's deadline (a sentence) and of its recovery (None)."""

    def __init__(
        self,
        fn: BatchFn[B, R],
        shape: Shape[R],
        policy: BatchPolicy,
        *,
        name: str = "batcher",
        on_wedged: Wedged | None = None,
    ) -> None:
        self.fn = fn
        self.shape = shape
        self.policy = policy
        self.name = name
        self._cap = BatchCap(name, policy.max_batch, policy.oom_recovery_s)
        self._intake: Intake[B, R] = Intake(name, policy, self._cap, shape)
        self._tally = Tally()
        self.stats = self._tally.stats  # the live totals (`snapshot` for a consistent copy)
        self._watchdog: Watchdog[B, R] = Watchdog(name, policy.deadline_s, on_wedged, self._tally)
        self._batch_ids = itertools.count(1)  # for spans and log lines
        self._runner_ids = itertools.count()
        self._threads: list[threading.Thread] = []
        for _ in range(policy.runners):
            self._start_runner()
        self._watchdog.start(lambda: self._intake.closed, self._start_runner)

    @property
    def max_batch(self) -> int:
        """Rows per batch now: the policy's, or less after an out-of-memory batch."""
        return self._cap.rows

    def _start_runner(self) -> None:
        number = next(self._runner_ids)
        thread = threading.Thread(
            target=self._run, name=f"{self.name}-runner-{number}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    # --- callers -------------------------------------------------------------------------

    def submit(self, block: B) -> Future[R]:
        queued = self._intake.put(block, None, None)
        assert queued is not None  # nothing to give up on
        return queued.future

    def expect(self, rows: int, urgent: bool = False) -> AbstractContextManager[Announcement[B, R]]:
        """Announce `rows` coming rows; rows not submitted by the end are written off.
        `urgent` rows go ahead of every queued row that is not."""
        return self._intake.expect(rows, urgent)

    def snapshot(self) -> BatchStats:
        """A consistent copy of the running totals (runners keep updating the live one)."""
        return self._tally.snapshot()

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the rows already queued, then stop the runners."""
        if not self._intake.close():
            return
        for thread in list(self._threads):
            thread.join(timeout)

    # --- runners -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._intake.cut()
            if batch is None:
                return
            if batch and not self._execute(batch):
                return  # the watchdog gave up on this runner and started another

    def _execute(self, batch: list[Taken[B, R]]) -> bool:
        """Run one batch; False when the watchdog expired it meanwhile (this runner retires)."""
        started = time.monotonic()
        batch_id = next(self._batch_ids)
        live = [t for t in batch if not t.queued.future.done()]  # an expired block is over
        rows = sum(len(t) for t in batch)
        with self._watchdog.watching(live, started) as running:
            origins = [t.queued.origin for t in batch]
            with batch_span(origins, batcher=self.name, batch_id=batch_id, batch_size=rows):
                if live:
                    self._run_or_split(live)
        if running.expired:
            return False
        seconds = time.monotonic() - started
        self._tally.batch(batch, started, seconds)
        log.debug(
            "%s: batch %d of %d rows in %.1f ms", self.name, batch_id, rows, seconds * 1000,
            extra={"batcher": self.name, "batch_id": batch_id, "batch_size": rows},
        )  # fmt: skip
        return True

    # --- bisecting to the bad row --------------------------------------------------------

    def _run_or_split(self, batch: list[Taken[B, R]]) -> None:
        rows = sum(len(t) for t in batch)
        if rows > self._cap.rows:  # the cap shrank after an out-of-memory: don't retry
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
            self._tally.failed()
            if is_out_of_memory(error):
                self._cap.shrink(rows, error)
                self._tally.out_of_memory()
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
            answer(taken, self.shape.cut(result, offset, offset + len(taken)), self.shape)
            offset += len(taken)

    def _split(self, batch: list[Taken[B, R]], rows: int) -> None:
        middle, left, right = rows // 2, [], []
        for taken in batch:
            if middle >= len(taken):
                left.append(taken)
            elif middle <= 0:
                right.append(taken)
            else:  # the part that straddles the middle
                cut = taken.start + middle
                left.append(Taken(taken.queued, taken.start, cut))
                right.append(Taken(taken.queued, cut, taken.stop))
            middle -= len(taken)
        self._run_or_split(left)
        self._run_or_split(right)

    def _fail(self, taken: Taken[B, R], error: Exception) -> None:
        """A row that fails alone: a transient error fails its whole block (the chunk runs
        again); any other is that row's answer."""
        if isinstance(error, TransientError):
            settle(taken.queued.future, error=error)
        else:
            answer(taken, self.shape.failed(len(taken), error), self.shape)
