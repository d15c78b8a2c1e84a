"""The chunk path's warm-up: its first-use costs paid before the first chunk, nothing written."""

from __future__ import annotations

import sys

import pytest
from sqlalchemy import func, select

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db.models import ChunkRun, Item, Job
from kiln.workers.chunk import warm
from kiln.workers.runtime import WorkerRuntime

MODEL = ModelInfo("m", "classify", "image", "", builtin=True, version="1")


def _rows(runtime: WorkerRuntime) -> tuple[int, int, int]:
    with runtime.sessions() as session:
        return tuple(  # type: ignore[return-value]
            int(session.scalar(select(func.count()).select_from(table)) or 0)
            for table in (Job, Item, ChunkRun)
        )


def test_warm_up_compiles_the_chunk_statements_and_writes_nothing(
    runtime: WorkerRuntime,
) -> None:
    before = _rows(runtime)
    cache = runtime.db._compiled_cache
    assert cache is not None
    compiled = len(cache)
    warm.warm(runtime, MODEL)
    assert _rows(runtime) == before
    assert len(cache) >= compiled + 5  # take, job, holds, close's read, forget
    assert "numpy.ma" in sys.modules


def test_warm_up_never_fails_the_run(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object) -> None:
        raise RuntimeError("database away")

    monkeypatch.setattr(warm, "warm_statements", broken)
    warm.warm(runtime, MODEL)  # logged, not raised
