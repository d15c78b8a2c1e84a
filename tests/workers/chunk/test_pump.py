"""The chunk's pump alone: fake prep futures and a fake Batcher announcement, a real ticket
lender and the chunk's rows. Every run must end with every ticket back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.errors import TransientError
from kiln.app.db.leases import LeasedItem
from kiln.app.families.fallback import FAILED
from kiln.workers.batching import Announcement
from kiln.workers.chunk.pump import FRAME_UNITS_AHEAD, ModelPass, Pump
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.models.base import Answers, Rows
from kiln.workers.ops.keeper import Held
from kiln.workers.prep.frames import FrameScheduler
from kiln.workers.prep.pool import Preparer
from kiln.workers.prep.slots import Lender
from kiln.workers.prep.units import Prepped, Unit
from kiln.workers.runners.runners import ModelRunner

MODEL = ModelInfo("m", "classify", "image", "", builtin=True, version="1")
WAIT_S = 5.0


class FakePrep:
    """Prep processes as the pump sees them: each unit's future, settled by `answer` at once
    (None: left for the test to settle)."""

    processes = 2

    def __init__(
        self,
        answer: Callable[[Unit], Prepped | None] | None = None,
        loads: dict[int, int] | None = None,
    ) -> None:
        self.answer = answer
        self.frames = FrameScheduler(lambda: loads or {})
        self.sent: list[tuple[Unit, int, Future[Prepped]]] = []
        self.on_submit: Callable[[], None] = lambda: None

    def submit(self, unit: Unit, prefer: int = -1) -> Future[Prepped]:
        self.on_submit()
        future: Future[Prepped] = Future()
        self.sent.append((unit, prefer, future))
        prepped = self.answer(unit) if self.answer else None
        if prepped is not None:
            future.set_result(prepped)
        return future


class FakeAnnouncement:
    """The Batcher as the pump sees it: each block's future, settled by `answer` at once (None:
    left for the test), rows skipped, and what `withdraw` takes back."""

    def __init__(self, answer: Callable[[Rows], Answers | None] | None = None) -> None:
        self.answer = answer
        self.blocks: list[tuple[Rows, Future[Answers]]] = []
        self.skipped = 0
        self.to_withdraw: dict[Future[Answers], int] = {}
        self.withdrawn: dict[Future[Answers], int] = {}

    def submit_unless(self, block: Rows, give_up: Callable[[], bool] | None) -> Future[Answers]:
        future: Future[Answers] = Future()
        self.blocks.append((block, future))
        answers = self.answer(block) if self.answer else None
        if answers is not None:
            future.set_result(answers)
        return future

    def skip(self, rows: int = 1) -> None:
        self.skipped += rows

    def withdraw(self) -> dict[Future[Answers], int]:
        taken, self.to_withdraw = self.to_withdraw, {}
        self.withdrawn |= taken
        return taken


def ok(unit: Unit) -> Prepped:
    return Prepped(0, [None] * len(unit), ["digest"] * len(unit), objects=list(unit.items))


def echo(block: Rows) -> Answers:
    """Each row answered with its own object (its item id)."""
    assert block.objects is not None
    return Answers(len(block.objects), {"id": pa.array(block.objects, pa.int64())})


def chunk(n: int, frames: bool = False) -> ChunkRows:
    return ChunkRows(
        [
            LeasedItem(
                i, "job", f"k{i}", f"store:{i}", None, 0, 1, frame_time_s=i if frames else None
            )
            for i in range(n)
        ]
    )


def units_of(n: int, size: int) -> list[np.ndarray]:
    rows = np.arange(n)
    return [rows[i : i + size] for i in range(0, n, size)]


def model_pass(
    prep: FakePrep, lender: Lender, finish: Callable[[Answers], Answers] = lambda a: a
) -> ModelPass:
    runner = SimpleNamespace(lender=lender, predictor=SimpleNamespace(prep=None, finish=finish))
    return ModelPass(
        MODEL, cast(ModelRunner, runner), cast(Preparer, prep), 1000, Held("job", "run")
    )


def pump(
    step: ModelPass, rows: ChunkRows, units: list[np.ndarray], announced: FakeAnnouncement
) -> Pump:
    return Pump(step, rows, units, cast(Announcement[Rows, Answers], announced))


def answered(rows: ChunkRows) -> list[int]:
    return sorted(int(r) for piece in rows.pieces for r in piece.rows)


def until(check: Callable[[], Any]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, "the pump never got there"
        time.sleep(0.005)


def in_thread(run: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    raised: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, raised


def test_every_row_is_prepared_batched_and_answered() -> None:
    lender, announced, rows = Lender(4), FakeAnnouncement(echo), chunk(10)
    step = model_pass(FakePrep(ok), lender)
    pump(step, rows, units_of(10, 2), announced).run({})
    assert answered(rows) == list(range(10))
    assert [p.columns["id"].to_pylist() for p in rows.pieces] == [
        r.tolist() for r in units_of(10, 2)
    ]
    assert step.held.answered == 10 and announced.skipped == 0
    assert lender.free == 4 and not rows.cancelled.any()


def test_rows_that_fail_to_prepare_fail_and_only_the_rest_are_batched() -> None:
    def some_fail(unit: Unit) -> Prepped:
        errors = [None if item % 3 else f"unreadable {item}" for item in unit.items]
        return Prepped(0, errors, ["digest"] * len(unit), objects=list(unit.items))

    lender, announced, rows = Lender(6), FakeAnnouncement(echo), chunk(9)
    step = model_pass(FakePrep(some_fail), lender)
    units = [np.array([0, 3, 6]), np.array([1, 2, 4]), np.array([5, 7, 8])]  # the first: all fail
    pump(step, rows, units, announced).run({})
    assert [len(block.objects or []) for block, _ in announced.blocks] == [3, 3]  # none for 0, 3, 6
    assert rows.errors[0] == "unreadable 0" and rows.failure[3] == FAILED
    assert answered(rows) == [1, 2, 4, 5, 7, 8]
    assert announced.skipped == 3 and step.held.answered == 9
    assert lender.free == 6


def test_a_cancel_stops_units_in_prep_unsent_and_queued_but_not_the_batch_running() -> None:
    """Two units in prep, two not sent (no tickets left): unit 0 comes back and queues; then the
    job cancels. Unsent units and the queued block's withdrawn rows are cancelled at once, unit
    1 when it comes back; the block still answers its rows already in a batch."""
    lender, announced, rows, prep = Lender(4), FakeAnnouncement(), chunk(8), FakePrep()
    step = model_pass(prep, lender)
    run = pump(step, rows, units_of(8, 2), announced)
    thread, raised = in_thread(lambda: run.run({}))
    until(lambda: len(prep.sent) == 2)
    prep.sent[0][2].set_result(ok(prep.sent[0][0]))
    until(lambda: len(announced.blocks) == 1)
    block = announced.blocks[0][1]
    announced.to_withdraw = {block: 1}  # row 0 is in a batch already, row 1 is not
    step.held.stop(step.held.cancelled)
    until(lambda: rows.cancelled[1])  # the last the stop marks
    assert rows.cancelled.tolist() == [False, True, False, False, True, True, True, True]
    prep.sent[1][2].set_result(ok(prep.sent[1][0]))  # back after the cancel
    withdrawn = "The job was cancelled."  # as the Batcher fails a withdrawn row
    block.set_result(Answers(2, {"id": pa.array([0, None], pa.int64())}, [None, withdrawn]))
    thread.join(WAIT_S)
    assert not thread.is_alive() and not raised
    assert len(prep.sent) == 2  # units 2 and 3 never started
    assert rows.cancelled.tolist() == [False] + [True] * 7
    assert answered(rows) == [0] and not any(rows.errors)  # the batch ran: its row is answered
    assert announced.skipped == 4 + 2 and lender.free == 4


def test_a_transient_prep_failure_gives_every_ticket_back() -> None:
    """Unit 0 fails transiently (the chunk runs again): its tickets go back, as do those of
    unit 1 (back, not handled) and unit 2 (still in prep, back after the run ended)."""

    def first_throttled(unit: Unit) -> Prepped | None:
        if unit.items[0] == 0:
            return Prepped(0, [None] * len(unit), [None] * len(unit), transient="throttled")
        return ok(unit) if unit.items[0] == 2 else None

    lender, prep = Lender(6), FakePrep(first_throttled)
    run = pump(model_pass(prep, lender), chunk(8), units_of(8, 2), FakeAnnouncement(echo))
    with pytest.raises(TransientError, match="throttled"):
        run.run({})
    assert len(prep.sent) == 3 and lender.free == 4  # unit 2 still holds its tickets
    prep.sent[2][2].set_result(ok(prep.sent[2][0]))
    assert lender.free == 6


def test_a_half_answered_block_after_a_stop_fails_its_failures_and_cancels_the_rest() -> None:
    """OCR's pages found, lines still to read, when the job cancels: no more batches start."""
    finished: list[Answers] = []
    held: list[Held] = []

    def finish(answers: Answers) -> Answers:
        finished.append(answers)
        return answers

    def half(block: Rows) -> Answers:
        held[0].stop(held[0].cancelled)  # the cancel comes while the batch runs
        return Answers(3, errors=[None, "no page", None], raw=["p0", None, "p2"])

    lender, announced, rows = Lender(3), FakeAnnouncement(half), chunk(3)
    step = model_pass(FakePrep(ok), lender, finish=finish)
    held.append(step.held)
    pump(step, rows, units_of(3, 3), announced).run({})
    assert not finished and not rows.pieces
    assert rows.cancelled.tolist() == [True, False, True]
    assert rows.errors[1] == "no page" and rows.failure[1] == FAILED
    assert lender.free == 3


def test_video_frames_go_to_one_process_a_few_units_at_a_time() -> None:
    """Frame units all go to the process claimed for the run, never more than
    FRAME_UNITS_AHEAD of them in prep, and the claim is given back at the end."""
    lender, prep, rows = Lender(8), FakePrep(ok, loads={5: 0}), chunk(8, frames=True)
    run = pump(model_pass(prep, lender), rows, units_of(8, 1), FakeAnnouncement(echo))
    in_prep: list[int] = []
    prep.on_submit = lambda: in_prep.append(run.in_prep)
    run.run({})
    assert len(in_prep) == 8 and max(in_prep) < FRAME_UNITS_AHEAD
    assert {prefer for _, prefer, _ in prep.sent} == {5}
    assert answered(rows) == list(range(8))
    assert [prep.frames.claim(), prep.frames.claim(), prep.frames.claim()] == [5, 5, None]
