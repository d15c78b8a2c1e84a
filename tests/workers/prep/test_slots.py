"""Shared-memory slots: lent and returned in blocks, written by another process, and never
left behind by a worker that died."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kiln.workers.prep import slots
from kiln.workers.prep.slots import (
    BYTE_SLOT,
    PREFIX,
    ByteSlots,
    SlotLayout,
    SlotPool,
    attach,
    reclaim,
    shm_dir,
)


def _fill(name: str, count: int, slot: int, value: int) -> None:
    segment = attach(name, SlotLayout((4, 4, 3)), count)
    segment.array[slot] = value
    segment.close()


def test_slots_are_lent_and_returned_in_blocks() -> None:
    pool = SlotPool(SlotLayout((2, 2)), 5, label="t")
    try:
        a = pool.acquire(3)
        assert a is not None and sorted(a.tolist()) == sorted(set(a.tolist()))
        assert pool.free == 2
        assert pool.acquire(3, timeout=0) is None  # only two left: no wait asked for
        pool.release(a)
        b = pool.acquire(5)
        assert b is not None and sorted(b.tolist()) == [0, 1, 2, 3, 4]
        with pytest.raises(RuntimeError):
            pool.release(np.concatenate([b, b]))
    finally:
        pool.close()


def test_a_thread_waits_for_slots_until_some_come_back() -> None:
    pool = SlotPool(SlotLayout((2,)), 2, label="t")
    taken = pool.acquire(2)
    assert taken is not None
    got: list[np.ndarray | None] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(1, timeout=5)))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # still waiting
    pool.release(taken[:1])
    waiter.join(5)
    assert got and got[0] is not None
    pool.close()


def test_another_process_writes_into_the_slots_by_name() -> None:
    pool = SlotPool(SlotLayout((4, 4, 3)), 3, label="t")
    try:
        child = multiprocessing.get_context("spawn").Process(
            target=_fill, args=(pool.name, 3, 1, 7)
        )
        child.start()
        child.join(30)
        assert child.exitcode == 0
        batch = pool.gather(np.array([1, 0]))
        assert (batch[0] == 7).all() and (batch[1] == 0).all()
    finally:
        pool.close()
    assert not (shm_dir() / pool.name).exists()  # unlinked on close


def test_reclaim_removes_the_segments_of_dead_owners_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment whose owner was killed (here: made by a child that got SIGKILL) is unlinked;
    one whose owner lives (it holds the lock) and files that are not Kiln's stay."""
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from kiln.workers.prep import slots\n"
        "slots.shm_dir = lambda: Path(sys.argv[1])\n"
        "pool = slots.SlotPool(slots.SlotLayout((4,)), 2, label='victim')\n"
        "print(pool.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", script, str(tmp_path)],
                           capture_output=True, text=True, check=False)  # fmt: skip
    victim = tmp_path / child.stdout.strip()
    assert child.returncode == -9 and victim.exists()
    other = tmp_path / "PostgreSQL.1234"
    other.write_bytes(b"x")
    monkeypatch.setattr(slots, "shm_dir", lambda: tmp_path)
    live = SlotPool(SlotLayout((4,)), 2, label="live")
    try:
        assert reclaim(tmp_path) == [victim.name]
        assert not victim.exists() and other.exists() and (tmp_path / live.name).exists()
    finally:
        live.close()


def test_a_full_shm_says_so_when_the_pool_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(_fd: int, _offset: int, _size: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"could not reserve .* larger /dev/shm"):
        SlotPool(SlotLayout((1024, 1024)), 4, label="big")
    assert not [p for p in shm_dir().glob(f"{PREFIX}{os.getpid()}-big-*")]


def test_a_name_outside_kiln_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Kiln slot segment"):
        attach("PostgreSQL.1234", SlotLayout((1,)), 1)


def test_byte_slots_are_read_in_place_and_outlive_their_pool_only_as_views() -> None:
    """A prep process writes a row's file into its byte slot (through the segment, as
    `attach` maps it); the engine reads it as a memoryview, not a copy; a view still held when
    the pool closes stays readable (the map goes with it), and the file is unlinked."""
    pool = ByteSlots(4, 1024, label="bytes")
    taken = pool.acquire(2)
    assert taken is not None
    theirs = attach(pool.name, pool.layout, pool.count)
    theirs.array[int(taken[1])][:5] = np.frombuffer(b"jpeg!", np.uint8)
    view = pool.view(int(taken[1]), 5)
    assert isinstance(view, memoryview) and bytes(view) == b"jpeg!"
    theirs.array[int(taken[1])][:1] = 74  # in place: a later write shows through
    assert bytes(view) == b"Jpeg!"
    theirs.close()
    pool.release(taken)
    assert pool.free == 4
    pool.close()
    assert not pool.segment.path.exists() and bytes(view) == b"Jpeg!"


def test_a_family_of_encoded_files_gets_byte_slots() -> None:
    from kiln.app.catalog.catalog import ModelInfo
    from kiln.workers.prep.spec import prep_spec
    from kiln.workers.runners.sizing import lender

    class Predictor:
        prep = prep_spec("kiln.workers.prep.images:HeaderPrep", {"max_pixels": 1}, byte_slots=True)

    info = ModelInfo("gpu-decoded", "classify", "image", "", builtin=True, version="1")
    made = lender(info, Predictor(), 32, 2, 2)  # type: ignore[arg-type]
    try:
        assert isinstance(made, ByteSlots) and made.size == BYTE_SLOT
        assert made.count >= 32 + 32  # a batch and a unit, at least
    finally:
        made.close()
