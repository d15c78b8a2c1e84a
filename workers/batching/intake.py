"""Where callers' blocks wait to be cut into batches, and the condition runners wait on (no
polling); bulk submitters waiting for room wait on a second one over the same lock, so a cut,
which makes room, wakes them and not every idle runner (with a dozen runners that was a dozen
wake-ups, each a GIL hand-over, per batch).

Callers `put` a block (through an `Announcement` when they said it was coming); a runner asks
for the next batch with `cut`: it blocks for a first row, then waits for more until the batch
is full, `max_delay_s` has passed since that row, or — `greedy` — no announced row is still on
its way, so a lone interactive image runs at once while a chunk being decoded still fills its
batch. Urgent blocks (interactive work) are cut before any bulk row and never wait for room;
bulk `put`s block while `max_queued` rows wait, so callers cannot run arbitrarily far ahead of
the engine. A cancelled caller withdraws its rows that no batch has taken yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Generic

from kiln.workers.batching.blocks import B, Queued, R, Shape, Taken, answer
from kiln.workers.batching.errors import BatcherClosedError, WithdrawnError
from kiln.workers.batching.oom import BatchCap
from kiln.workers.batching.policy import BatchPolicy

GIVE_UP_POLL_S = 0.25  # how often a submitter waiting for room asks whether to give up


class Announcement(Generic[B, R]):
    """Rows a caller said it will submit; `submit` through it counts them down."""

    def __init__(self, intake: Intake[B, R], rows: int, urgent: bool = False) -> None:
        self._intake = intake
        self.remaining = rows
        self.urgent = urgent
        self._queued: deque[Queued[B, R]] = deque()  # its blocks, for `withdraw`

    def submit(self, block: B) -> Future[R]:
        future = self.submit_unless(block, None)
        assert future is not None  # nothing to give up on
        return future

    def submit_unless(self, block: B, give_up: Callable[[], bool] | None) -> Future[R] | None:
        """The block's future; None when `give_up` became true while the queue was full (the
        block was not queued)."""
        queued = self._intake.put(block, self, give_up)
        if queued is None:
            return None
        # Answered blocks have nothing to withdraw: dropped from the front, as blocks mostly
        # end in order, not by a pass over every block per submit (quadratic in a chunk's
        # blocks: 256 units of 2 rows made 32,000 `done()` calls). `withdraw` skips the rest.
        while self._queued and self._queued[0].future.done():
            self._queued.popleft()
        self._queued.append(queued)
        return queued.future

    def skip(self, rows: int = 1) -> None:
        """Rows that will not come after all (a bad input, a cached result)."""
        self._intake.write_off(self, rows)

    def withdraw(self) -> dict[Future[R], int]:
        """Take back every row of this caller's blocks that no batch has taken yet. Returns,
        per block that lost rows, the first row withdrawn (rows from there to the block's end);
        each such block still answers, its withdrawn rows failed with `WithdrawnError`, once
        its rows already in a batch are answered."""
        return self._intake.withdraw(self._queued)


class Intake(Generic[B, R]):
    """The queued blocks (urgent and bulk), their row counts, and the rows announced."""

    def __init__(self, name: str, policy: BatchPolicy, cap: BatchCap, shape: Shape[R]) -> None:
        self.name = name
        self.policy = policy
        self.cap = cap  # the live batch size a cut fills to
        self.shape = shape
        self._blocks: deque[Queued[B, R]] = deque()
        # Blocks of interactive work: taken before any queued bulk row, never held back by a
        # full queue (bulk rows fill it), so one uploaded image is not stuck behind a bucket.
        self._urgent: deque[Queued[B, R]] = deque()
        self._rows = 0  # rows queued and not yet cut into a batch, both queues
        self._bulk_rows = 0
        self.announced = 0  # rows announced and not yet submitted
        # One lock, two waiting rooms: runners wait for rows (`_cond`), bulk submitters for
        # room in the queue (`_room`), so a cut, which makes room, wakes no idle runner.
        lock = threading.RLock()  # a Condition's own default
        self._cond = threading.Condition(lock)
        self._room = threading.Condition(lock)
        self.closed = False

    # --- callers -------------------------------------------------------------------------

    @contextmanager
    def expect(self, rows: int, urgent: bool = False) -> Iterator[Announcement[B, R]]:
        """Announce `rows` coming rows; rows not submitted by the end are written off."""
        announcement: Announcement[B, R] = Announcement(self, rows, urgent)
        with self._cond:
            self.announced += rows
        try:
            yield announcement
        finally:
            self.write_off(announcement, announcement.remaining)

    def write_off(self, announcement: Announcement[B, R], rows: int) -> None:
        with self._cond:
            rows = min(rows, announcement.remaining)
            # Nothing a runner waits on changes: no one to wake (a chunk writes off 0 rows
            # per unit that prepared whole, and at its end).
            if rows <= 0:
                return
            self.announced -= rows
            announcement.remaining -= rows
            self._cond.notify_all()  # a runner may be waiting for those rows

    def put(
        self,
        block: B,
        announcement: Announcement[B, R] | None,
        give_up: Callable[[], bool] | None,
    ) -> Queued[B, R] | None:
        """Queue `block` (once there is room for bulk rows); None when `give_up` became true
        while waiting for room. An empty block is answered at once."""
        urgent = announcement is not None and announcement.urgent
        queued: Queued[B, R] = Queued(block, urgent)
        if not queued.rows:
            queued.future.set_result(self.shape.join([]))
            return queued
        max_queued = self.policy.max_queued
        with self._cond:
            while (
                not urgent
                and not self.closed
                and max_queued is not None
                and self._bulk_rows >= max_queued
            ):
                if give_up is not None and give_up():
                    return None
                # With a give_up test, look at it now and then: nothing notifies a cancel.
                self._room.wait(None if give_up is None else GIVE_UP_POLL_S)
            if self.closed:
                raise BatcherClosedError(f"{self.name} is closed.")
            (self._urgent if urgent else self._blocks).append(queued)
            before = self._rows
            self._rows += queued.rows
            if not urgent:
                self._bulk_rows += queued.rows
            if announcement is not None:
                counted = min(queued.rows, announcement.remaining)
                announcement.remaining -= counted
                self.announced -= counted
            if self._worth_waking(before):
                self._cond.notify_all()
        return queued

    def withdraw(self, blocks: Sequence[Queued[B, R]]) -> dict[Future[R], int]:
        """Remove the uncut rows of `blocks` from the queues; answer them as withdrawn."""
        withdrawn: list[tuple[Queued[B, R], int]] = []
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
            self._room.notify_all()  # room in the queue for blocked submitters
        for queued, start in withdrawn:
            error = WithdrawnError("The job was cancelled.")
            failed = self.shape.failed(queued.rows - start, error)
            answer(Taken(queued, start, queued.rows), failed, self.shape)
        return {queued.future: start for queued, start in withdrawn}

    def close(self) -> bool:
        """Refuse new blocks and wake everyone waiting; False when it was closed already."""
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            self._cond.notify_all()
            self._room.notify_all()
        return True

    def _worth_waking(self, before: int) -> bool:
        """Whether a new block changes what a runner would do: the first rows start a runner's
        delay, a full batch is cut at once, and a greedy runner cuts when no announced row is
        still coming. Any other block waits for the cut."""
        return (
            before == 0
            or self._rows >= self.cap.rows
            or (self.policy.greedy and self.announced <= 0)
        )

    # --- runners -------------------------------------------------------------------------

    def cut(self) -> list[Taken[B, R]] | None:
        """The next batch: block for a first row, then wait for more until full, the delay
        has passed, or (greedy) no announced row is still coming. Empty when another runner
        cut the rows meanwhile; None once closed and drained."""
        with self._cond:
            while not self._rows:
                if self.closed:
                    return None
                self._cond.wait()
            self.cap.grow_after_quiet()
            first = self._urgent[0] if self._urgent else self._blocks[0]
            deadline = first.enqueued + self.policy.max_delay_s
            # Rows stay queued until the cut, so submitters need not wake this runner per block.
            while self._rows < self.cap.rows:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.closed or (self.policy.greedy and self.announced <= 0):
                    break
                self._cond.wait(remaining)
                if not self._rows:  # another runner cut them meanwhile
                    return [] if not self.closed else None
            batch = self._take(min(self.cap.rows, self._rows))
            self._room.notify_all()  # room in the queue for blocked submitters
            if self._rows:
                self._cond.notify()  # rows left for the next batch: one runner more, not all
            return batch

    def _take(self, rows: int) -> list[Taken[B, R]]:
        """Under `_cond`: `rows` rows from the head blocks, urgent first; a block may be split."""
        batch: list[Taken[B, R]] = []
        while rows:
            queue = self._urgent if self._urgent else self._blocks
            queued = queue[0]
            take = min(rows, queued.rows - queued.cut)
            batch.append(Taken(queued, queued.cut, queued.cut + take))
            queued.cut += take
            rows -= take
            self._rows -= take
            if not queued.urgent:
                self._bulk_rows -= take
            if queued.cut == queued.rows:
                queue.popleft()
        return batch
