"""The embedding families' job-closed step: groups by cosine similarity over the vectors in the
job's shards, only when the job asked (`options.group`), written as phash's groups are."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kiln.app.catalog import builtin_model
from kiln.app.core.errors import InputError
from kiln.app.db.models import Job
from kiln.app.families import check_options
from kiln.app.results import Place, ResultRow, write_shard
from kiln.app.storage.local import LocalStore
from kiln.workers.models import embed, vector_groups
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.loader import job_closed

FIELDS = embed.fields({"dim": 3})
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
    }
    rows = pq.read_table(io.BytesIO(place.store.get(entry["key"]))).to_pylist()  # type: ignore[index]
    assert [(r["group"], r["key"]) for r in rows] == [(0, "a"), (0, "a-copy")]
    assert rows[0]["similarity"] == 1.0
    expected = 0.99 / np.linalg.norm(VECTORS["a-copy"])
    assert rows[1]["similarity"] == pytest.approx(expected, abs=1e-6)


def test_no_group_option_no_groups(tmp_path: Path) -> None:
    place = _place(tmp_path)
    assert _close(place, {}) == {}
    assert not place.store.exists("results/j/groups.parquet")


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


def test_a_job_too_large_for_exact_grouping_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vector_groups, "MAX_EXACT", 3)
    place = _place(tmp_path)
    entry = _close(place, {"group": {"threshold": 0.95}})["groups"]
    assert entry == {
        "skipped": "4 vectors is more than exact grouping takes (3); grouping by an "
        "approximate index is not built yet",
        "threshold": 0.95,
    }
    assert not place.store.exists("results/j/groups.parquet")
