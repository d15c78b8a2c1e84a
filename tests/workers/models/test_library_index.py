"""A pipeline library's vector index (workers/models/vector_groups.py) when a run has no vector
to add: the first run of a pipeline whose every object failed leaves an empty index with no
dimension, which the next run must be able to fill."""

from __future__ import annotations

from pathlib import Path

from kiln.app.db.models import Job
from kiln.app.results import vector_index
from kiln.app.results.results import Place, ResultRow, library_place, write_shard
from kiln.app.storage.local import LocalStore
from kiln.workers.models import embed, vector_groups
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.library import update as update_library

FIELDS = embed.fields({"dim": 3})


def close_run(store: LocalStore, job: str, rows: list[ResultRow]) -> dict[str, object]:
    place = Place(store, f"results/{job}/")
    write_shard(place, 0, rows, FIELDS)
    library = update_library(library_place(store, 5, "embed:1"), place, [])
    return vector_groups.close_job(ClosedJob(Job(id=job, options={}), lambda: [], place, library))


def test_a_library_whose_first_run_failed_takes_the_next_runs_vectors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    failed = close_run(store, "r1", [ResultRow("a", "failed", "The file is empty.", 1.0, None)])
    assert failed["library_index"]["vectors"] == 0  # type: ignore[index]

    vectors = {"a": [1.0, 0.0, 0.0], "b": [0.0, 1.0, 0.0]}
    rows = [
        ResultRow(k, "succeeded", None, 1.0, {"embedding": v, "dim": 3}) for k, v in vectors.items()
    ]
    summary = close_run(store, "r2", rows)
    assert summary["library_index"]["vectors"] == 2  # type: ignore[index]
    index = vector_index.load(library_place(store, 5, "embed:1"))
    assert (index.dim, sorted(index.labels.values())) == (3, ["a", "b"])
