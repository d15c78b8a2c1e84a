"""`kiln run`'s prep processes started ahead (workers/prep/ahead.py): how many, and the run
taking them over."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.images import solid
from kiln.app.core.config import get_settings
from kiln.workers.embedded import run_embedded
from kiln.workers.prep.ahead import SMALL_RUN, few_images, prep_count, start_ahead
from kiln.workers.prep.pool import PrepPool, usable_cores
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings


def images(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(count):
        (folder / f"{n}.jpg").write_bytes(b"")
    return folder


def test_a_few_images_are_a_small_run(tmp_path: Path) -> None:
    folder = images(tmp_path / "few", SMALL_RUN - 1)
    images(folder / "sub", 1)
    (folder / ".DS_Store").write_bytes(b"")  # hidden: never an input
    assert few_images(str(folder))
    assert few_images(str(folder / "0.jpg"))
    assert few_images(str(folder / "*.jpg"))


@pytest.mark.parametrize(
    "extra",
    ["clip.mp4", ".clip.mp4", "clip", "notes.txt"],  # videos; files that may be (bytes say)
)
def test_a_file_that_may_be_a_video_is_not_a_small_run(tmp_path: Path, extra: str) -> None:
    folder = images(tmp_path / "mixed", 3)
    (folder / extra).write_bytes(b"")
    assert not few_images(str(folder))
    assert not few_images(str(folder / extra))


def test_more_images_than_a_small_run(tmp_path: Path) -> None:
    folder = images(tmp_path / "many", SMALL_RUN + 1)
    assert not few_images(str(folder))
    assert not few_images(str(folder / "*.jpg"))


def test_how_many_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_PREP_PROCESSES", raising=False)
    few, many = images(tmp_path / "few", 3), images(tmp_path / "many", SMALL_RUN + 1)
    auto = get_settings(data_dir=tmp_path)
    assert prep_count(auto, str(few)) == 1
    assert prep_count(auto, str(many)) == auto.prep_count(usable_cores())
    assert prep_count(auto, str(tmp_path / "missing")) == 0  # refused before any is needed
    assert prep_count(auto, str(tmp_path / "missing" / "*.jpg")) == 1  # a glob: looked at
    three = auto.model_copy(update={"prep_processes": 3})
    assert prep_count(three, str(few)) == 3  # as configured
    assert prep_count(auto.model_copy(update={"prep_processes": 0}), str(few)) == 0
    assert start_ahead(auto, str(tmp_path / "missing")) is None


def test_the_run_takes_over_the_processes_started_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch, chunk_size=4)
    folder = tmp_path / "photos"
    folder.mkdir()
    for n in range(3):
        (folder / f"{n}.png").write_bytes(solid((n * 80, 40, 200)))
    prep = start_ahead(settings, str(folder))
    assert isinstance(prep, PrepPool) and prep.processes == 1
    pids = prep.pids()
    outcome = run_embedded(settings, str(folder), "phash", prep=prep)
    assert outcome.progress.counts.succeeded == 3
    assert prep.prep_settings.local_inputs  # files are read where they are
    assert all(not p.process.is_alive() for p in prep._procs)  # closed with the run
    assert pids and prep.pids() == pids  # none replaced: the run used these


def test_a_runtime_takes_prep_processes_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch)
    runtime = WorkerRuntime(settings)
    pool = PrepPool(settings, 1)
    try:
        runtime.use_prep(pool)
        assert runtime.prep is pool
        with pytest.raises(RuntimeError, match="already started"):
            runtime.use_prep(PrepPool.__new__(PrepPool))
    finally:
        runtime.close()
    assert all(not p.process.is_alive() for p in pool._procs)
