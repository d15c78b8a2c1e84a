"""The embedding families' job-closed step: groups by cosine similarity over the vectors in the
job's shards, only when the job asked (`options.group`), written as phash's groups are."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kiln.app.catalog.catalog import builtin_model
from kiln.app.core.errors import InputError
from kiln.app.db.models import Job
from kiln.app.families import check_options
from kiln.app.results import vector_index
from kiln.app.results.results import Place, ResultRow, write_shard
from kiln.app.storage.local import LocalStore
from kiln.workers.models import embed, vector_groups
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.library import library_place
from kiln.workers.models.library import update as update_library
from kiln.workers.models.loader import job_closed

FIELDS = embed.fields({"dim": 3})


class _AnyInt(int):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0

    __hash__ = int.__hash__


ANY_INT = _AnyInt(1)
VECTORS = {
    "a": [1.0, 0.0, 0.0],
    "a-copy": [0.99, 0.05, 0.0],  # cosine 0.9987 with a
    "b": [0.0, 1.0, 0.0],
    "c": [0.0, 0.0, 1.0],
}


def _place(tmp_path: Path) -> Place:
    place = Place(LocalStore(tmp_path), "results/j/")
    rows = [
        ResultRow(key, "succeeded", None, 1.0, {"embedding": vector, "dim": 3})
        for key, vector in VECTORS.items()
    ]
    write_shard(place, 0, rows[:2], FIELDS)
    failed = ResultRow("broken", "failed", "The file is empty.", 1.0, None)
    write_shard(place, 1, [*rows[2:], failed], FIELDS)
    return place


def _close(place: Place, options: dict[str, object]) -> dict[str, object]:
    job = Job(id="j", options=options)
    return vector_groups.close_job(ClosedJob(job, lambda: [], place))


def test_groups_are_written_with_each_members_similarity(tmp_path: Path) -> None:
    place = _place(tmp_path)
    entry = _close(place, {"group": {"threshold": 0.95}})["groups"]
    assert entry == {
        "key": "results/j/groups.parquet",
        "threshold": 0.95,
        "groups": 1,
        "items_in_groups": 2,
        "exact": True,
    }
    rows = pq.read_table(io.BytesIO(place.store.get(entry["key"]))).to_pylist()  # type: ignore[index]
    assert [(r["group"], r["key"]) for r in rows] == [(0, "a"), (0, "a-copy")]
    assert rows[0]["similarity"] == 1.0
    expected = 0.99 / np.linalg.norm(VECTORS["a-copy"])
    assert rows[1]["similarity"] == pytest.approx(expected, abs=1e-6)


def test_no_group_option_no_groups_but_the_index_for_search(tmp_path: Path) -> None:
    place = _place(tmp_path)
    summary = _close(place, {})
    assert summary == {
        "index": {"key": "results/j/index.usearch", "vectors": 4, "dim": 3, "bytes": ANY_INT}
    }
    assert not place.store.exists("results/j/groups.parquet")
    index = vector_index.load(place)
    assert len(index) == 4
    [nearest] = index.search(np.asarray([VECTORS["a"]], np.float32), 2)
    assert [n.key for n in nearest] == ["a", "a-copy"]


def test_a_job_with_no_vectors_has_no_index(tmp_path: Path) -> None:
    place = Place(LocalStore(tmp_path), "results/j/")
    write_shard(place, 0, [ResultRow("x", "failed", "The file is empty.", 1.0, None)], FIELDS)
    assert _close(place, {"group": {}})["groups"]["groups"] == 0  # type: ignore[index]
    assert not vector_index.exists(place)


def test_the_default_threshold_and_its_bounds() -> None:
    assert check_options("embed", "clip", {"group": {}}) == {"group": {}}
    assert vector_groups.EmbedOptions.stored({"group": {}}).group.threshold == 0.92  # type: ignore[union-attr]
    with pytest.raises(InputError, match=r"must be a cosine similarity from 0\.5 to 1"):
        check_options("text-embed", "text-embed", {"group": {"threshold": 0.2}})
    with pytest.raises(InputError, match="has no option 'groups'"):
        check_options("embed", "clip", {"groups": {}})


def test_a_vector_with_nan_fails_its_item() -> None:
    with pytest.raises(InputError, match="NaN or infinity"):
        embed.require_finite(np.array([1.0, np.nan], dtype=np.float32))


def test_text_embed_and_phash_have_job_closed_steps() -> None:
    assert job_closed(builtin_model("text-embed")) is vector_groups.close_job
    assert job_closed(builtin_model("detector")) is None


def test_a_large_job_groups_through_the_approximate_index_as_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_index, "EXACT_MAX", 3)
    place = _place(tmp_path)
    entry = _close(place, {"group": {"threshold": 0.95}})["groups"]
    assert entry["exact"] is False  # type: ignore[index]
    rows = pq.read_table(io.BytesIO(place.store.get("results/j/groups.parquet"))).to_pylist()
    assert [(r["group"], r["key"]) for r in rows] == [(0, "a"), (0, "a-copy")]


def _run_place(store: LocalStore, job: str, vectors: dict[str, list[float]]) -> Place:
    place = Place(store, f"results/{job}/")
    rows = [
        ResultRow(key, "succeeded", None, 1.0, {"embedding": vector, "dim": 3}, f"d-{key}")
        for key, vector in vectors.items()
    ]
    write_shard(place, 0, rows, FIELDS)
    return place


def test_a_pipeline_run_groups_and_indexes_the_whole_library(tmp_path: Path) -> None:
    """The second run processes only a new copy of `a`: it joins last run's `a` in the groups,
    and the library's index holds every object (the changed `b` replaced, not added twice)."""
    store = LocalStore(tmp_path)
    where = library_place(store, 3, "embed:1")
    options = {"group": {"threshold": 0.95}}
    first = _run_place(store, "r1", {"a": VECTORS["a"], "b": VECTORS["b"], "c": VECTORS["c"]})
    job = Job(id="r1", options=options)
    library = update_library(where, first, [])
    vector_groups.close_job(ClosedJob(job, lambda: [], first, library))

    second = _run_place(store, "r2", {"a-copy": VECTORS["a-copy"], "b": [0.0, 0.8, 0.6]})
    library = update_library(where, second, [])
    summary = vector_groups.close_job(
        ClosedJob(Job(id="r2", options=options), lambda: [], second, library)
    )

    assert summary["library_index"]["vectors"] == 4  # type: ignore[index]
    assert summary["index"]["vectors"] == 2  # type: ignore[index]  # the run's own
    rows = pq.read_table(io.BytesIO(store.get("results/r2/groups.parquet"))).to_pylist()
    assert [(r["group"], r["key"]) for r in rows] == [(0, "a"), (0, "a-copy")]
    index = vector_index.load(where)
    assert sorted(index.labels.values()) == ["a", "a-copy", "b", "c"]
    changed = index.vector_of("b")
    assert changed is not None and changed[2] == pytest.approx(0.6, abs=1e-3)  # float16 kept
