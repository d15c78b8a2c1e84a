"""The chunk's pump: one model's pass over some of a chunk's rows, prep → batch → engine, a
unit at a time, on the chunk's thread.

The thread lends each unit tickets of the model's pool (slots, byte slots, or tickets alone)
and sends it to the prep processes; a unit that comes back becomes a block for the model's
Batcher (its rows that failed to prepare fail with their sentence, and give their tickets back
at once); a settled block gives its tickets back from the runner's thread and its answers
become a piece of the chunk's results. The thread only waits for tickets when nothing of its
own is in prep, so chunks never hold each other's slots hostage. A cancel or a lost lease
stops every row no batch has taken: units not sent, units back from prep, and the chunk's
blocks still queued in the Batcher are cancelled; rows already in a batch finish.

What comes back reaches the thread as events on one queue: `PrepDone`, `BlockDone`,
`StopAsked` (the lease keeper wakes it on a cancel or a lost lease). What a stop does to every
row still waiting is decided in `Cancel`; which prep process decodes video frames, and how
many frame units may be in prep, in `FrameAffinity`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.errors import TransientError
from kiln.app.families.fallback import FAILED, REFUSED
from kiln.app.video import Sampling
from kiln.workers.batching import Announcement
from kiln.workers.chunk.rows import ChunkRows, Piece
from kiln.workers.models.base import Answers, Rows
from kiln.workers.ops.keeper import Held
from kiln.workers.prep.frames import FrameScheduler
from kiln.workers.prep.pool import Preparer
from kiln.workers.prep.slots import ByteSlots, Lender, SlotPool
from kiln.workers.prep.units import Prepped, Unit, in_place
from kiln.workers.runners.runners import ModelRunner

SLOT_WAIT_S = 1.0  # a thread waiting for slots looks at its lease this often
# Units of video frames in prep at once per chunk: they all go to one prep process, which
# decodes them in order, so more would only hold slots the chunks of other processes need.
FRAME_UNITS_AHEAD = 2


@dataclass
class ModelPass:
    """What running rows through one model needs: the model (as the job names it) and its
    loaded runner, the prep processes, how large an input may be, the lease (to stop on a
    cancel), and whether the chunk is interactive."""

    model: ModelInfo
    runner: ModelRunner
    prep: Preparer
    max_bytes: int
    held: Held
    urgent: bool = False
    sampling: Sampling | None = None  # the job's, for its videos


def make_unit(
    model_pass: ModelPass,
    rows: ChunkRows,
    indices: np.ndarray,
    read_only: bool = False,
    tickets: np.ndarray | None = None,
) -> Unit:
    """The unit prep gets for `indices`. `tickets`: lent to its rows, each a slot (pixels) or a
    byte slot (the row's encoded file, read in place), or only a ticket (rows that travel as
    objects)."""
    items = [rows.items[i] for i in indices.tolist()]
    frames = [item.frame_time_s for item in items]
    unit = Unit(
        0,
        model_pass.runner.predictor.prep,
        [item.id for item in items],
        [item.source for item in items],
        [item.text for item in items],
        model_pass.max_bytes,
        read_only=read_only,
        frames=frames if any(f is not None for f in frames) else None,
        sampling=model_pass.sampling,
    )
    lent = model_pass.runner.lender
    if tickets is not None and isinstance(lent, (SlotPool, ByteSlots)):
        unit.slots, unit.segment, unit.segment_slots = tickets, lent.name, lent.count
        if isinstance(lent, ByteSlots):
            unit.slot_bytes = lent.size
    return unit


def block_rows(lender: Lender, prepped: Prepped, ok: np.ndarray, tickets: np.ndarray) -> Rows:
    """A unit's good rows (`ok`) as the Batcher takes them: their slots, fit or objects (those
    in byte slots as views of the bytes, in place)."""
    objects = prepped.objects
    if objects is not None and isinstance(lender, ByteSlots):
        objects = in_place(objects, lender, tickets)
    return Rows(
        slots=tickets[ok] if isinstance(lender, SlotPool) else None,
        meta=None if prepped.meta is None else prepped.meta[ok],
        objects=None
        if objects is None
        else [o for o, good in zip(objects, ok, strict=True) if good],
    )


# --- the events ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """Rows of the chunk queued in the Batcher as one block, in order."""

    rows: np.ndarray
    submitted: float  # when it was queued: its rows' engine time runs from here


@dataclass(frozen=True, slots=True, eq=False)
class PrepDone:
    """A unit is back from prep (or its prep raised), with the tickets lent to it."""

    unit: np.ndarray
    tickets: np.ndarray
    future: Future[Prepped]


@dataclass(frozen=True, slots=True, eq=False)
class BlockDone:
    """A block settled (its tickets went back already, on the runner's thread)."""

    block: Block
    future: Future[Answers]


@dataclass(frozen=True, slots=True)
class StopAsked:
    """The lease keeper woke the thread: the loop looks at the lease again."""


Event = PrepDone | BlockDone | StopAsked


class Inbox:
    """The chunk thread's events, posted from prep, runner and keeper threads. A run abandoned
    (a transient fault) reads no more: a unit back from prep, or still to come back, gives its
    tickets back here (blocks in the engine give theirs back when they settle)."""

    def __init__(self, lender: Lender) -> None:
        self.lender = lender
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()  # `_abandoned` against the posting threads
        self._abandoned = False

    def post(self, event: Event) -> None:
        with self._lock:
            if not self._abandoned:
                self._events.put(event)
            elif isinstance(event, PrepDone):
                self.lender.release(event.tickets)

    def get(self) -> Event:
        return self._events.get()

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            while not self._events.empty():
                event = self._events.get_nowait()
                if isinstance(event, PrepDone):
                    self.lender.release(event.tickets)


# --- beside the pump: video frames, and what a stop does ------------------------------------


class FrameAffinity:
    """The prep process for a run's video frames: claimed when the first frame unit goes (the
    one decoding the fewest stretches), then the same for every frame unit after, so its
    reader decodes on where the last unit stopped; given back when the run ends. It reads
    them one after another, so at most FRAME_UNITS_AHEAD units are in prep at once."""

    def __init__(self, rows: ChunkRows, scheduler: FrameScheduler) -> None:
        self.rows = rows
        self.scheduler = scheduler
        self.process: int | None = None

    def admits(self, unit: np.ndarray, in_prep: int, wait: bool) -> bool:
        """Whether `unit` may go to prep now (`wait`: wait a while for a process): any unit
        but video frames may; frames wait while FRAME_UNITS_AHEAD units are in prep, or while
        every process decodes as many stretches as it keeps readers for."""
        if not self._frames(unit):
            return True
        if in_prep >= FRAME_UNITS_AHEAD:
            return False
        if self.process is None:
            self.process = self.scheduler.claim(SLOT_WAIT_S if wait else 0)
        return self.process is not None

    def where(self, unit: np.ndarray, prefer: int) -> int:
        """The prep process for `unit`: `prefer` (the one holding its bytes, -1: any), else
        this run's frame process for frames."""
        if prefer < 0 and self.process is not None and self._frames(unit):
            return self.process
        return prefer

    def release(self) -> None:
        if self.process is not None:
            self.scheduler.release(self.process)

    def _frames(self, unit: np.ndarray) -> bool:
        return self.rows.items[int(unit[0])].frame_time_s is not None


class Cancel:
    """What a stop (the job cancels, or the lease is lost) does to a run: rows no batch has
    taken never will be; rows already in a batch finish. Decided here for every place a row
    can be when the stop comes; `asked` is the question the pump puts before each step."""

    def __init__(
        self, held: Held, rows: ChunkRows, announced: Announcement[Rows, Answers], lender: Lender
    ) -> None:
        self.asked = held.stopping
        self.rows, self.announced, self.lender = rows, announced, lender

    def waiting(self, pending: deque[np.ndarray], blocks: dict[Future[Answers], Block]) -> None:
        """Units not sent are never started: cancelled. The run's blocks still queued in the
        Batcher are taken back: each still answers, its withdrawn rows cancelled here."""
        for unit in pending:
            self.rows.cancelled[unit] = True
            self.announced.skip(len(unit))
        pending.clear()
        for future, start in self.announced.withdraw().items():
            self.rows.cancelled[blocks[future].rows[start:]] = True

    def prepared(self, unit: np.ndarray, ok: np.ndarray, tickets: np.ndarray) -> None:
        """A unit back from prep: its rows that prepared well are cancelled (its failures
        stand), its tickets go back."""
        self.rows.cancelled[unit[ok]] = True
        self.lender.release(tickets)
        self.announced.skip(len(unit))

    def unqueued(self, block: Block, tickets: np.ndarray) -> None:
        """A block the Batcher's full queue kept out until the stop: never queued."""
        self.lender.release(tickets)
        self.rows.cancelled[block.rows] = True

    def half_answered(self, block: Block, answers: Answers) -> None:
        """A block half answered (OCR's pages found, lines still to read): the rest would be
        a new batch each, which a stop starts no more. Rows the engine failed fail, the others
        are cancelled."""
        good = fail_failed(self.rows, block.rows, answers.error_list(), answers.refused_list())
        self.rows.cancelled[block.rows[good]] = True


# --- the pump -------------------------------------------------------------------------------


class Pump:
    """One model's pass over some units of a chunk: the event loop of the chunk's thread. In
    flight at once: units in prep (each holding its tickets) and blocks in the Batcher, as many
    as the model's tickets allow."""

    def __init__(
        self,
        model_pass: ModelPass,
        rows: ChunkRows,
        units: list[np.ndarray],
        announced: Announcement[Rows, Answers],
    ) -> None:
        self.model_pass, self.rows, self.announced = model_pass, rows, announced
        self.pending = deque(units)
        self.in_prep = 0
        self.blocks: dict[Future[Answers], Block] = {}  # in the Batcher, by their future
        self.lender = model_pass.runner.lender  # bounds our rows in prep and queued (tickets)
        self.frames = FrameAffinity(rows, model_pass.prep.frames)
        self.cancel = Cancel(model_pass.held, rows, announced, self.lender)
        self.inbox = Inbox(self.lender)

    def run(self, holder: dict[int, int]) -> None:
        """`holder`: rows already read (content cache on) and by which prep process."""
        woken = self.model_pass.held.on_stop(lambda: self.inbox.post(StopAsked()))
        try:
            while self.pending or self.in_prep or self.blocks:
                if self.cancel.asked():
                    self.cancel.waiting(self.pending, self.blocks)
                self._send(holder, wait=False)
                if self.pending and not self.in_prep:
                    self._send(holder, wait=True)  # nothing of ours in prep: wait
                    continue
                if self.in_prep or self.blocks:
                    self._handle(self.inbox.get())
        except BaseException:
            self.inbox.abandon()
            raise
        finally:
            woken()
            self.frames.release()

    def _send(self, holder: dict[int, int], wait: bool) -> None:
        """Send units while tickets allow (`wait`: block for the first one's a while), unless
        the lease says stop: a unit not sent is not started."""
        while self.pending and not self.cancel.asked():
            unit = self.pending[0]
            if not self.frames.admits(unit, self.in_prep, wait):
                return
            tickets = self.lender.acquire(len(unit), timeout=SLOT_WAIT_S if wait else 0)
            if tickets is None:
                return
            self._to_prep(self.pending.popleft(), tickets, holder.get(int(unit[0]), -1))
            if wait:
                return

    def _to_prep(self, unit: np.ndarray, tickets: np.ndarray, prefer: int) -> None:
        sent = make_unit(self.model_pass, self.rows, unit, tickets=tickets)
        future = self.model_pass.prep.submit(sent, self.frames.where(unit, prefer))
        self.in_prep += 1
        future.add_done_callback(lambda done: self.inbox.post(PrepDone(unit, tickets, done)))

    def _handle(self, event: Event) -> None:
        match event:
            case PrepDone(unit, tickets, future):
                self.in_prep -= 1
                try:
                    prepped = future.result()
                    record_prep(self.rows, unit, prepped)
                except BaseException:
                    self.lender.release(tickets)  # a transient fault: the chunk runs again
                    raise
                self._prepared(unit, tickets, prepped)
            case BlockDone(block, future):
                self._answered(block, future)
            case StopAsked():
                pass  # the loop looks at the lease again

    def _prepared(self, unit: np.ndarray, tickets: np.ndarray, prepped: Prepped) -> None:
        """A unit is back from prep: its good rows go to the Batcher as one block (a video is
        not a row: its frames become items of their own), its failed rows give their tickets
        back."""
        ok = np.array([e is None for e in prepped.errors], dtype=bool)
        if prepped.videos is not None:
            ok &= np.array([v is None for v in prepped.videos], dtype=bool)
        if self.cancel.asked():
            self.cancel.prepared(unit, ok, tickets)
            return
        if not ok.all():
            self.lender.release(tickets[~ok])  # rows that failed to prepare need no ticket
            self.model_pass.held.answered += int((~ok).sum())
        self.announced.skip(int((~ok).sum()))
        if not ok.any():
            return
        rows, held = block_rows(self.lender, prepped, ok, tickets), tickets[ok]
        block = Block(unit[ok], time.monotonic())
        try:
            future = self.announced.submit_unless(rows, self.cancel.asked)
        except BaseException:  # the Batcher closed (the model unloads, the worker stops)
            self.lender.release(held)
            raise
        if future is None:  # stopped while the Batcher's queue was full
            self.cancel.unqueued(block, held)
            return
        self.blocks[future] = block
        lender = self.lender
        future.add_done_callback(lambda _: lender.release(held))  # on the runner's thread
        future.add_done_callback(lambda done: self.inbox.post(BlockDone(block, done)))

    def _answered(self, block: Block, future: Future[Answers]) -> None:
        self.blocks.pop(future, None)
        answers = future.result()  # a transient failure (a stuck engine) retries the chunk
        if answers.raw is not None and self.cancel.asked():
            self.cancel.half_answered(block, answers)
        else:
            record_answers(self.model_pass, self.rows, block, answers)


def record_answers(model_pass: ModelPass, rows: ChunkRows, block: Block, answers: Answers) -> None:
    """A settled block's answers, finished on the chunk's thread: failed rows fail, the others
    become a piece of the results (rows withdrawn from the Batcher on a cancel are cancelled
    already)."""
    engine = time.monotonic() - block.submitted
    started = time.monotonic()
    answers = model_pass.runner.predictor.finish(answers)
    post = (time.monotonic() - started) / max(1, len(block.rows))
    model_pass.held.answered += len(block.rows)
    rows.seconds[block.rows, 2] = engine
    rows.seconds[block.rows, 3] = post
    if answers.errors is None:  # the usual block: every row answered
        rows.answer(Piece(block.rows, answers.columns, model_pass.model))
        return
    keep = fail_failed(rows, block.rows, answers.errors, answers.refused_list())
    if len(keep):
        columns = {name: col.take(keep) for name, col in answers.columns.items()}
        rows.answer(Piece(block.rows[keep], columns, model_pass.model))


def fail_failed(
    rows: ChunkRows, block: np.ndarray, errors: list[str | None], refused: list[bool]
) -> np.ndarray:
    """Fail a block's rows that have an error (tagged refused or failed); the positions of
    the rest, less rows already cancelled (withdrawn before a batch took them)."""
    good = []
    for position, (error, was_refused) in enumerate(zip(errors, refused, strict=True)):
        row = int(block[position])
        if rows.cancelled[row]:
            continue
        if error is None:
            good.append(position)
        else:
            rows.fail(row, error, REFUSED if was_refused else FAILED)
    return np.asarray(good, dtype=np.int64)


def record_prep(rows: ChunkRows, unit: np.ndarray, prepped: Prepped) -> None:
    """What prep found of a unit's rows: videos, digests, failures and its seconds (a
    transient fault raises: the chunk runs again)."""
    if prepped.transient is not None:
        raise TransientError(prepped.transient)
    if prepped.videos is not None:
        for row, plan in zip(unit.tolist(), prepped.videos, strict=True):
            if plan is not None:
                rows.videos[row] = plan
    for row, error, digest in zip(unit.tolist(), prepped.errors, prepped.sha256, strict=True):
        if digest is not None:
            rows.sha256[row] = digest
        if error is not None:
            # Not a model's failure when nothing could be read: no fallback could read it either.
            rows.fail(row, error, FAILED if digest is not None else None)
    if prepped.seconds is not None:
        rows.seconds[unit, 0] += prepped.seconds[:, 0]
        rows.seconds[unit, 1] += prepped.seconds[:, 1]
