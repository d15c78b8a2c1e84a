"""Encoded files through a chunk's real path — prep processes, byte slots, Batcher — on the
GPU-decode path's prep half (`HeaderPrep`): each file reaches the batch as a memoryview of its
byte slot (or, larger than a slot, with the answer), bad files fail alone with their
sentence, and every slot goes back: after the chunk, after a cancel, after a dead process."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from devstack.images import photo, truncated_jpeg
from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.app.db.leases import LeasedItem
from kiln.workers.chunk.answer import run_model
from kiln.workers.chunk.pump import ModelPass
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.models.base import Answers, Batch
from kiln.workers.ops.keeper import Held
from kiln.workers.prep.pool import PrepPool
from kiln.workers.prep.slots import ByteSlots
from kiln.workers.prep.spec import prep_spec
from kiln.workers.runners.build import model_batcher
from kiln.workers.runners.runners import ModelRunner
from tests.support import migrated_settings

SLOT = 8 * 2**10  # small: the 640×480 photo does not fit, the 64×48 ones do


class Encoded:
    """A predictor whose rows are encoded files (as the GPU-decode image predictor's): it notes
    what each batch row was, and answers its size."""

    backend = "test"
    max_batch = 4
    max_runners = 1

    def __init__(self) -> None:
        self.prep = prep_spec(
            "kiln.workers.prep.images:HeaderPrep", {"max_pixels": 10**8}, meta_width=4,
            byte_slots=True,
        )  # fmt: skip
        self.seen: list[tuple[type, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()  # a batch has reached the predictor

    def infer(self, batch: Batch) -> Answers:
        self.entered.set()
        self.gate.wait(30)
        rows = batch.objects or []
        self.seen += [(type(data), sha256_hex(bytes(data))) for data, _header in rows]
        return Answers(len(rows), {"size": pa.array([len(data) for data, _ in rows])})

    def finish(self, answers: Answers) -> Answers:
        return answers


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, local_inputs=True)


@pytest.fixture
def pool(settings: Settings) -> Iterator[PrepPool]:
    pool = PrepPool(settings, 2)
    yield pool
    pool.close()


def files(folder: Path) -> list[Path]:
    datas = [photo(i, (64, 48)) for i in range(9)] + [photo(9), truncated_jpeg(1), b"text"]
    paths = []
    for i, data in enumerate(datas):
        path = folder / f"{i:02d}.jpg"
        path.write_bytes(data)
        paths.append(path)
    return paths


def chunk(settings: Settings, pool: PrepPool, predictor: Encoded, paths: list[Path], held: Held):  # type: ignore[no-untyped-def]
    """Run the files as one chunk; returns its rows and the byte slots (closed)."""
    info = ModelInfo("encoded", "classify", "image", "", builtin=True, version="1")
    slots = ByteSlots(40, SLOT, label="test")
    batcher = model_batcher(settings, info.ref, info.name, predictor, 4, 1, None, lambda _: None)  # type: ignore[arg-type]
    runner = ModelRunner(info, predictor, batcher, slots)  # type: ignore[arg-type]
    items = [LeasedItem(i, "job", p.name, p.as_uri(), None, 0, 1) for i, p in enumerate(paths)]
    rows = ChunkRows(items)
    try:
        run_model(ModelPass(info, runner, pool, 10**7, held), rows, np.arange(len(items)), {})
        assert slots.free == slots.count, "byte slots were not all given back"
    finally:
        batcher.close()
        slots.close()
    return rows


def test_files_reach_the_batch_in_place_and_every_slot_goes_back(
    settings: Settings, pool: PrepPool, tmp_path: Path
) -> None:
    paths = files(tmp_path)
    predictor = Encoded()
    rows = chunk(settings, pool, predictor, paths, Held("job", "me"))
    seen = dict((digest, kind) for kind, digest in predictor.seen)
    for path in paths[:10]:  # nine small files in place, the large one with the answer
        kind = memoryview if path != paths[9] else bytes
        assert seen[sha256_hex(path.read_bytes())] is kind, path.name
    assert rows.errors[:10] == [None] * 10
    assert rows.errors[10] is None  # truncated: its header reads; the device decode fails it
    assert rows.errors[11] == "The file is neither an image nor a video Kiln can read."


def test_a_cancelled_chunk_gives_every_slot_back(
    settings: Settings, pool: PrepPool, tmp_path: Path
) -> None:
    """Cancelled while its first batch runs: the blocks still queued are withdrawn, units
    back from prep are let go — and the slots of all of them come back."""
    predictor = Encoded()
    predictor.gate.clear()
    held = Held("job", "me")

    def cancel() -> None:  # once the first batch runs, however slowly prep started
        predictor.entered.wait(30)
        held.stop(held.cancelled)
        predictor.gate.set()

    threading.Thread(target=cancel, daemon=True).start()
    rows = chunk(settings, pool, predictor, files(tmp_path) * 3, held)
    assert rows.cancelled.any()


def test_dead_prep_processes_lose_no_slot(
    settings: Settings, pool: PrepPool, tmp_path: Path
) -> None:
    """Both prep processes killed while they hold the chunk's units (one blocked reading a
    FIFO): their replacements prepare the units again, in the same slots."""
    fifo = tmp_path / "slow.jpg"
    os.mkfifo(fifo)

    def write() -> None:
        with fifo.open("wb") as end:  # waits for a replacement to open it
            end.write(b"not an image")

    def kill() -> None:
        for pid in pool.pids():
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pool.replaced < 2 and time.monotonic() < deadline:  # the dead never read it
            time.sleep(0.05)
        threading.Thread(target=write, daemon=True).start()

    killer = threading.Timer(1.0, kill)
    killer.start()
    rows = chunk(settings, pool, Encoded(), [fifo, *files(tmp_path)], Held("job", "me"))
    killer.join()
    assert pool.replaced >= 2
    assert rows.errors[0] == "The file is neither an image nor a video Kiln can read."
    assert sum(e is None for e in rows.errors) == 11
