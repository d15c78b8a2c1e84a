"""Run some of a chunk's rows through one model: prep → batch → engine, a unit at a time.

The chunk's thread splits the rows into units, lends each unit slots of the model's pool and
sends it to the prep processes; a unit that comes back becomes a block for the model's Batcher
(its rows that failed to prepare fail with their sentence, and give their slots back at once);
a settled block gives its slots back from the runner's thread and its answers become a piece
of the chunk's results. The thread only waits for slots when nothing of its own is in prep, so
chunks never hold each other's slots hostage. A cancel or a lost lease (the lease keeper wakes
the thread) stops every row no batch has taken: units not sent, units back from prep, and the
chunk's blocks still queued in the Batcher are cancelled; rows already in a batch finish.

With the content cache on, units first only *read* their items (fetch and hash, bytes kept in
the prep process); one lookup answers what the cache knows, and only the rest is decoded.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.app.catalog import ModelInfo
from kiln.app.core.errors import TransientError
from kiln.app.families.fallback import FAILED, REFUSED
from kiln.app.video import Sampling
from kiln.workers.batching import Announcement
from kiln.workers.chunk.rows import ChunkRows, Piece
from kiln.workers.models.base import Answers, Rows
from kiln.workers.ops.keeper import Held
from kiln.workers.prep.pool import Preparer
from kiln.workers.prep.slots import ByteSlots
from kiln.workers.prep.units import UNIT_ROWS, Prepped, Unit, in_place
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


def plan_units(rows: np.ndarray, processes: int, most: int | None = None) -> list[np.ndarray]:
    """Rows in units of at most `most` (UNIT_ROWS), about one per prep process for a small
    chunk."""
    if not len(rows):
        return []
    size = max(1, min(most or UNIT_ROWS, math.ceil(len(rows) / max(1, processes))))
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def make_unit(
    model_pass: ModelPass, rows: ChunkRows, indices: np.ndarray, read_only: bool = False
) -> Unit:
    items = [rows.items[i] for i in indices.tolist()]
    frames = [item.frame_time_s for item in items]
    return Unit(
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


# --- reading first (content cache on) ----------------------------------------------------


def read_all(model_pass: ModelPass, rows: ChunkRows, indices: np.ndarray) -> dict[int, int]:
    """Fetch and hash every row (its bytes stay in the prep process that read them); returns
    row → that process, for the prepare units to go back to it. A unit not sent before the
    lease says stop is not started: its rows are cancelled."""
    units = plan_units(indices, model_pass.prep.processes)
    sent: list[tuple[np.ndarray, Future[Prepped]]] = []
    for unit in units:
        if model_pass.held.stopping():
            rows.cancelled[unit] = True
            continue
        sent.append(
            (unit, model_pass.prep.submit(make_unit(model_pass, rows, unit, read_only=True)))
        )
    holder: dict[int, int] = {}
    for unit, future in sent:
        prepped = future.result()
        _record_prep(rows, unit, prepped)
        holder |= dict.fromkeys(unit.tolist(), prepped.worker)
    return holder


# --- prepare, batch, answer ---------------------------------------------------------------


@dataclass
class _Block:
    rows: np.ndarray  # chunk rows of the block, in order
    submitted: float


class _Run:
    """One model's pass over some rows of a chunk: the event loop of the chunk's thread."""

    def __init__(self, model_pass: ModelPass, rows: ChunkRows, units: list[np.ndarray]) -> None:
        self.model_pass, self.rows = model_pass, rows
        self.pending = deque(units)
        self.events: queue.SimpleQueue[tuple[str, Any, Future[Any]]] = queue.SimpleQueue()
        self.in_prep = self.in_engine = 0
        self.lender = model_pass.runner.lender  # bounds our rows in prep and queued (tickets)
        self.pool = model_pass.runner.slots  # the same lender, when rows go into slots
        # ... or when rows are encoded files, written into byte slots and read in place
        self.bytes = self.lender if isinstance(self.lender, ByteSlots) else None
        self.blocks: dict[Future[Answers], _Block] = {}  # in the Batcher, by their future
        self._lock = threading.Lock()  # `aborted` against the callbacks that queue events
        self.aborted = False
        self.frame_process: int | None = None  # where this run's video frames are decoded

    def run(self, holder: dict[int, int]) -> None:
        """`holder`: rows already read (content cache on) and by which prep process."""
        predictor = self.model_pass.runner.predictor
        total = sum(len(u) for u in self.pending)
        woken = self.model_pass.held.on_stop(lambda: self.events.put(("stop", None, Future())))
        with self.model_pass.runner.batcher.expect(total, self.model_pass.urgent) as announced:
            try:
                while self.pending or self.in_prep or self.in_engine:
                    if self.model_pass.held.stopping():
                        self._stop(announced)
                    self._dispatch(holder, wait=False)
                    if self.pending and not self.in_prep:
                        self._dispatch(holder, wait=True)  # nothing of ours in prep: wait
                        continue
                    if self.in_prep or self.in_engine:
                        event = self.events.get()
                        self._handle(*event, announced=announced, finish=predictor.finish)
            except BaseException:
                self._abandon()
                raise
            finally:
                woken()
                if self.frame_process is not None:
                    self.model_pass.prep.frames.release(self.frame_process)

    def _abandon(self) -> None:
        """The run stops early (a transient fault): slots lent to units still in prep, or back
        from it but not handled, go back to the pool (blocks in the engine give theirs back
        when they settle)."""
        with self._lock:
            self.aborted = True
            while not self.events.empty():
                kind, payload, _future = self.events.get_nowait()
                if kind == "prep":
                    self._release(payload[1])

    def _release(self, tickets: np.ndarray) -> None:
        self.lender.release(tickets)

    def _stop(self, announced: Announcement[Rows, Answers]) -> None:
        """The job is cancelling, or the lease is lost: rows no batch has taken never will be.
        Units not sent are cancelled here, the chunk's blocks still queued in the Batcher are
        taken back (their blocks answer, the withdrawn rows cancelled), and units still in
        prep are cancelled as they come back (`_prepared`)."""
        for unit in self.pending:
            self.rows.cancelled[unit] = True
            announced.skip(len(unit))
        self.pending.clear()
        for future, start in announced.withdraw().items():
            self.rows.cancelled[self.blocks[future].rows[start:]] = True

    def _dispatch(self, holder: dict[int, int], wait: bool) -> None:
        """Send units while slots allow (`wait`: block for the first one's slots a while),
        unless the lease says stop: a unit not sent is not started."""
        while self.pending:
            unit = self.pending[0]
            if self.model_pass.held.stopping():
                return
            if self._frames(unit):
                if self.in_prep >= FRAME_UNITS_AHEAD:
                    return  # its process reads them one after another: no slots held idle
                if not self._claim_frame_process(wait):
                    return  # every process decodes as many stretches as it keeps readers for
            tickets = self.lender.acquire(len(unit), timeout=SLOT_WAIT_S if wait else 0)
            if tickets is None:
                return
            self.pending.popleft()
            sent = make_unit(self.model_pass, self.rows, unit)
            self._lend(sent, tickets)
            prefer = holder.get(int(unit[0]), -1)
            if prefer < 0 and self.frame_process is not None and self._frames(unit):
                prefer = self.frame_process
            future = self.model_pass.prep.submit(sent, prefer)
            self.in_prep += 1
            future.add_done_callback(self._event("prep", (unit, tickets)))
            if wait:
                return

    def _lend(self, sent: Unit, tickets: np.ndarray) -> None:
        """Where the unit's rows go: a ticket is a slot (pixels) or a byte slot (each row's
        encoded file), or only a ticket (rows that travel as objects)."""
        lent = self.pool or self.bytes
        if lent is not None:
            sent.slots, sent.segment, sent.segment_slots = tickets, lent.name, lent.count
        if self.bytes is not None:
            sent.slot_bytes = self.bytes.size

    def _claim_frame_process(self, wait: bool) -> bool:
        """The prep process for this run's video frames: claimed when the first unit goes (the
        one decoding the fewest stretches), then the same for every unit after, so its reader
        decodes on where the last unit stopped. False: none is free yet."""
        if self.frame_process is None:
            self.frame_process = self.model_pass.prep.frames.claim(SLOT_WAIT_S if wait else 0)
        return self.frame_process is not None

    def _frames(self, unit: np.ndarray) -> bool:
        return self.rows.items[int(unit[0])].frame_time_s is not None

    def _event(self, kind: str, payload: Any) -> Callable[[Future[Any]], None]:
        def put(future: Future[Any]) -> None:
            with self._lock:
                if not self.aborted:
                    self.events.put((kind, payload, future))
                elif kind == "prep":
                    self._release(payload[1])

        return put

    def _handle(
        self,
        kind: str,
        payload: Any,
        future: Future[Any],
        *,
        announced: Announcement[Rows, Answers],
        finish: Callable[[Answers], Answers],
    ) -> None:
        if kind == "stop":
            return  # the loop looks at the lease again
        if kind == "prep":
            self.in_prep -= 1
            unit, slots = payload
            try:
                prepped = future.result()
                _record_prep(self.rows, unit, prepped)
            except BaseException:
                self._release(slots)  # a transient fault: the chunk runs again
                raise
            self._prepared(unit, slots, prepped, announced)
        else:
            self.in_engine -= 1
            self._answered(payload, future, finish)

    def _prepared(
        self,
        unit: np.ndarray,
        tickets: np.ndarray,
        prepped: Prepped,
        announced: Announcement[Rows, Answers],
    ) -> None:
        """A unit is back from prep: its good rows go to the Batcher as one block (a video is
        not a row: its frames become items of their own) — unless the run must stop, when
        they are cancelled instead."""
        ok = np.array([e is None for e in prepped.errors], dtype=bool)
        if prepped.videos is not None:
            ok &= np.array([v is None for v in prepped.videos], dtype=bool)
        if self.model_pass.held.stopping():
            self._cancel_prepared(unit, ok, tickets, announced)
            return
        if not ok.all():
            self._release(tickets[~ok])  # rows that failed to prepare need no slot
            self.model_pass.held.answered += int((~ok).sum())
        announced.skip(int((~ok).sum()))
        if not ok.any():
            return
        objects = prepped.objects
        if objects is not None and self.bytes is not None:  # views of the bytes, in place
            objects = in_place(objects, self.bytes, tickets)
        held = tickets[ok]
        block = Rows(
            slots=held if self.pool is not None else None,
            meta=None if prepped.meta is None else prepped.meta[ok],
            objects=None
            if objects is None
            else [o for o, good in zip(objects, ok, strict=True) if good],
        )
        entry = _Block(unit[ok], time.monotonic())
        try:
            future = announced.submit_unless(block, self.model_pass.held.stopping)
        except BaseException:  # the Batcher closed (the model unloads, the worker stops)
            self._release(held)
            raise
        if future is None:  # stopped while the Batcher's queue was full
            self._release(held)
            self.rows.cancelled[entry.rows] = True
            return
        self.blocks[future] = entry
        self.in_engine += 1
        lender = self.lender
        future.add_done_callback(lambda _: lender.release(held))  # on the runner's thread
        future.add_done_callback(self._event("block", entry))

    def _cancel_unfinished(self, block: _Block, answers: Answers) -> None:
        """A half-answered block after a stop: its rows the engine failed fail, the others
        are cancelled."""
        good = _fail_failed(self.rows, block.rows, answers.error_list(), answers.refused_list())
        self.rows.cancelled[block.rows[good]] = True

    def _cancel_prepared(
        self,
        unit: np.ndarray,
        ok: np.ndarray,
        tickets: np.ndarray,
        announced: Announcement[Rows, Answers],
    ) -> None:
        """A unit back from prep after the run was told to stop: its rows that prepared well
        are cancelled (their failures stand), its slots go back."""
        self.rows.cancelled[unit[ok]] = True
        self._release(tickets)
        announced.skip(len(unit))

    def _answered(
        self, block: _Block, future: Future[Answers], finish: Callable[[Answers], Answers]
    ) -> None:
        """A block's answers: failed rows fail, the others become a piece of the results (rows
        withdrawn from the Batcher on a cancel are cancelled already)."""
        self.blocks.pop(future, None)
        engine = time.monotonic() - block.submitted
        answers = future.result()  # a transient failure (a stuck engine) retries the chunk
        if answers.raw is not None and self.model_pass.held.stopping():
            # Half answered (OCR's pages found, lines still to read): the rest of the work
            # would be a new batch each, which a cancel starts no more.
            self._cancel_unfinished(block, answers)
            return
        started = time.monotonic()
        answers = finish(answers)
        post = (time.monotonic() - started) / max(1, len(block.rows))
        self.model_pass.held.answered += len(block.rows)
        self.rows.seconds[block.rows, 2] = engine
        self.rows.seconds[block.rows, 3] = post
        if answers.errors is None:  # the usual block: every row answered
            self.rows.answer(Piece(block.rows, answers.columns, self.model_pass.model))
            return
        keep = _fail_failed(self.rows, block.rows, answers.errors, answers.refused_list())
        if len(keep):
            columns = {name: col.take(keep) for name, col in answers.columns.items()}
            self.rows.answer(Piece(block.rows[keep], columns, self.model_pass.model))


def _fail_failed(
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


def _record_prep(rows: ChunkRows, unit: np.ndarray, prepped: Prepped) -> None:
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


def run_model(
    model_pass: ModelPass, rows: ChunkRows, indices: np.ndarray, holder: dict[int, int]
) -> None:
    """Prepare, batch and answer `indices` of the chunk with the pass's model."""
    _Run(model_pass, rows, plan_prepare(indices, holder, model_pass.prep.processes)).run(holder)


def plan_prepare(indices: np.ndarray, holder: dict[int, int], processes: int) -> list[np.ndarray]:
    """The units that prepare `indices`. Rows already read (`holder`: row → the prep process
    keeping its bytes) are planned per process, so each unit goes back to the bytes it needs,
    in whole units of up to UNIT_ROWS: the read units were spread over the processes already,
    and cutting each process's rows again into `processes` pieces only multiplies the round
    trips, chunk-thread events and Batcher blocks (16 processes made a 512-row chunk 256 units
    of 2)."""
    if not holder:
        return plan_units(indices, processes)
    by_worker: dict[int, list[int]] = {}
    for row in indices.tolist():
        by_worker.setdefault(holder.get(row, -1), []).append(row)
    return [unit for group in by_worker.values() for unit in plan_units(np.asarray(group), 1)]


def drop_held(
    model_pass: ModelPass, rows: ChunkRows, done: list[int], holder: dict[int, int]
) -> None:
    """Rows read for nothing more (the cache answered them): their prep processes may let
    their bytes go now rather than when newer ones push them out."""
    by_worker: dict[int, list[int]] = {}
    for row in done:
        by_worker.setdefault(holder.get(row, -1), []).append(rows.items[row].id)
    for worker, items in by_worker.items():
        unit = Unit(
            0, model_pass.runner.predictor.prep, [], [], [], model_pass.max_bytes, drop=items
        )
        model_pass.prep.submit(unit, worker)  # nothing to wait for
