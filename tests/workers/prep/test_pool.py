"""The prep processes as a worker runs them: real spawned interpreters, killed, crashed and
stuck on purpose. Every item ends exactly once, and one bad file fails alone."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.workers.prep.pool import InlinePrep, PrepClosedError, PrepPool
from kiln.workers.prep.slots import SlotLayout, SlotPool
from kiln.workers.prep.spec import prep_spec
from kiln.workers.prep.units import Unit
from tests.support import migrated_settings

TEXTS = prep_spec("tests.workers.prep.stand_ins:TextPrep", {})
SLOTTED = prep_spec("tests.workers.prep.stand_ins:TextPrep", {}, SlotLayout((2,)), meta_width=1)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, local_inputs=True)


@pytest.fixture
def pool(settings: Settings) -> Iterator[PrepPool]:
    # Not so short that a process still starting on a loaded machine (CI's two cores, `-n 2`)
    # is taken for a stuck one: that kill would be a replacement no test asked for.
    pool = PrepPool(settings, 2, stuck_s=10.0)
    yield pool
    pool.close()


def texts(*values: str, spec=TEXTS) -> Unit:  # type: ignore[no-untyped-def]
    return Unit(0, spec, list(range(len(values))), [None] * len(values), list(values), 1000)


def files(*paths: Path, read_only: bool = False) -> Unit:
    sources: list[str | None] = [p.as_uri() for p in paths]
    return Unit(0, TEXTS, list(range(len(paths))), sources, [None] * len(paths), 1000,
                read_only=read_only)  # fmt: skip


def test_units_are_answered_by_the_prep_processes(pool: PrepPool) -> None:
    futures = [pool.submit(texts(f"a{i}", f"b{i}")) for i in range(10)]
    answers = [f.result(30) for f in futures]
    assert [a.objects for a in answers] == [[f"A{i}", f"B{i}"] for i in range(10)]
    assert answers[0].sha256 == [sha256_hex("a0"), sha256_hex("b0")]
    assert {a.worker for a in answers} <= {1, 2} and len(pool.pids()) == 2


def test_a_pool_not_started_starts_its_processes_with_its_first_unit(settings: Settings) -> None:
    waiting = PrepPool(settings, 1, stuck_s=10.0, start=False)
    try:
        assert waiting.pids() == []  # a worker's runtime holds it before it runs any chunk
        assert waiting.submit(texts("a")).result(30).objects == ["A"]
        assert len(waiting.pids()) == 1
    finally:
        waiting.close()
    never = PrepPool(settings, 1, start=False)
    never.close()  # closes without ever starting
    assert never.pids() == [] and never.frames.claim() == -1  # and starts nothing after


def test_an_input_error_fails_its_item_alone(pool: PrepPool) -> None:
    answer = pool.submit(texts("ok", "BAD input", "fine")).result(30)
    assert answer.errors == [None, "That input is bad.", None]
    assert answer.objects == ["OK", None, "FINE"]


def test_prep_writes_into_the_engine_process_slots(pool: PrepPool) -> None:
    slots = SlotPool(SlotLayout((2,)), 4, label="test")
    try:
        unit = texts("abc", "hello", spec=SLOTTED)
        taken = slots.acquire(2)
        assert taken is not None
        unit.slots, unit.segment, unit.segment_slots = taken, slots.name, slots.count
        answer = pool.submit(unit).result(30)
        assert answer.errors == [None, None]
        assert slots.gather(taken).tolist() == [[3, 3], [5, 5]]
        assert answer.meta is not None and answer.meta[:, 0].tolist() == [3, 5]
    finally:
        slots.close()


def test_an_idle_process_unmaps_the_slots_of_a_model_the_worker_unloaded(
    settings: Settings,
) -> None:
    pool = PrepPool(settings, 1)
    slots = SlotPool(SlotLayout((2,)), 4, label="gone")
    try:
        unit = texts("abc", spec=SLOTTED)
        taken = slots.acquire(1)
        assert taken is not None
        unit.slots, unit.segment, unit.segment_slots = taken, slots.name, slots.count
        assert pool.submit(unit).result(60).errors == [None]
        [pid] = pool.pids()
        maps = Path(f"/proc/{pid}/maps")
        assert slots.name in maps.read_text()
        slots.close()  # the model is unloaded: its segment unlinked
        deadline = time.monotonic() + 10
        while slots.name in maps.read_text():  # no unit comes to make it look
            assert time.monotonic() < deadline, "the prep process still maps the unloaded slots"
            time.sleep(0.1)
    finally:
        slots.close()
        pool.close()


def test_an_input_that_crashes_its_process_fails_alone_with_a_sentence(pool: PrepPool) -> None:
    answer = pool.submit(texts("first", "CRASH here", "last")).result(60)
    assert answer.objects == ["FIRST", None, "LAST"]
    assert answer.errors[0] is None and answer.errors[2] is None
    assert "stopped Kiln's decoder process twice (signal 6)" in (answer.errors[1] or "")
    assert pool.replaced >= 2
    assert pool.submit(texts("after")).result(30).objects == ["AFTER"]  # the pool lives on


def test_a_killed_prep_process_is_replaced_and_its_unit_redone(
    pool: PrepPool, tmp_path: Path
) -> None:
    """SIGKILL while a unit is in hand (its process blocked reading a FIFO): the unit runs
    again in the replacement, and every item is answered once."""
    fifo, plain = tmp_path / "slow.fifo", tmp_path / "plain.txt"
    os.mkfifo(fifo)
    plain.write_text("plain")
    future = pool.submit(files(fifo, plain))
    time.sleep(1.0)  # the process that took it is blocked opening the FIFO
    victim = next(p for p in pool._procs if p.tasks)
    os.kill(victim.process.pid or 0, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while pool.replaced == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.replaced == 1 and not future.done()
    writer = threading.Thread(target=lambda: fifo.write_text("through the pipe"))
    writer.start()
    answer = future.result(30)
    writer.join(5)
    assert answer.errors == [None, None]
    assert answer.objects == ["THROUGH THE PIPE", "PLAIN"]


def test_a_stuck_prep_process_is_killed_and_its_item_fails(settings: Settings) -> None:
    pool = PrepPool(settings, 2, stuck_s=1.0)  # a start-up taken for silence kills it too
    try:
        answer = pool.submit(texts("HANG forever")).result(60)
    finally:
        pool.close()
    assert "stopped Kiln's decoder process twice (signal 9)" in (answer.errors[0] or "")


def test_read_bytes_are_kept_for_the_prepare_that_follows(pool: PrepPool, tmp_path: Path) -> None:
    """With the content cache on, a unit first reads and hashes; its prepare decodes the
    bytes the same process kept — here the file is gone by then."""
    path = tmp_path / "once.txt"
    path.write_text("kept")
    read = pool.submit(files(path, read_only=True)).result(30)
    assert read.sha256 == [sha256_hex(b"kept")] and read.errors == [None]
    path.unlink()
    answer = pool.submit(files(path), prefer=read.worker).result(30)
    assert answer.errors == [None] and answer.objects == ["KEPT"]
    assert answer.sha256 == read.sha256  # the hash taken when it was read


def test_closing_fails_what_is_outstanding(settings: Settings) -> None:
    pool = PrepPool(settings, 1, stuck_s=60)
    future = pool.submit(texts("HANG"))
    time.sleep(0.5)
    pool.close(timeout=1)
    with pytest.raises(PrepClosedError):
        future.result(10)


def test_inline_prep_runs_the_same_units_on_the_calling_thread(settings: Settings) -> None:
    inline = InlinePrep(settings)
    answer = inline.submit(texts("x", "BAD")).result(0)
    assert answer.objects == ["X", None] and answer.errors == [None, "That input is bad."]
    assert np.asarray(answer.seconds).shape == (2, 2)
    inline.close()


def test_only_the_unit_in_hand_is_charged_with_its_process_death(settings: Settings) -> None:
    """A one-image unit queued behind a hostile one on the same process is sent again with
    it each time that process dies, but never blamed: it succeeds, the hostile item fails."""
    pool = PrepPool(settings, 1, stuck_s=60)
    try:
        hostile = pool.submit(texts("CRASH now"))
        innocent = pool.submit(texts("just a caption"))
        assert innocent.result(60).objects == ["JUST A CAPTION"]
        assert "stopped Kiln's decoder process twice" in (hostile.result(60).errors[0] or "")
    finally:
        pool.close()


def test_one_thread_in_the_engine_process_serves_every_prep_process(pool: PrepPool) -> None:
    assert pool.submit(texts("x")).result(30).objects == ["X"]
    names = [t.name for t in threading.enumerate() if t.name.startswith("kiln-prep")]
    assert names == ["kiln-prep-io"]


def test_a_full_pipe_never_blocks_the_caller(pool: PrepPool, tmp_path: Path) -> None:
    """A process stuck on a unit (opening a FIFO) while units pile up far past what its pipe
    holds: each submit returns at once; the rest waits in the process's outbox, and every unit
    is answered, in full, once the process reads again."""
    fifo = tmp_path / "slow.fifo"
    os.mkfifo(fifo)
    stuck = pool.submit(files(fifo), prefer=1)
    big = ["w" * 100_000 + str(i) for i in range(20)]  # 2 MB: many times a pipe's buffer
    started = time.monotonic()
    futures = [pool.submit(texts(text), prefer=1) for text in big]
    assert time.monotonic() - started < 5  # written as far as the pipe takes, no further
    proc = next(p for p in pool._procs if p.id == 1)
    assert proc.outbox and not any(f.done() for f in futures)
    threading.Thread(target=lambda: fifo.write_text("unstuck")).start()
    assert stuck.result(30).objects == ["UNSTUCK"]
    assert [f.result(60).objects for f in futures] == [[text.upper()] for text in big]
