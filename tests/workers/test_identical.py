"""Byte-identical inputs join the job's groups, whatever the model (`merge` in
workers/models/grouping.py, `join_identical` in workers/close/steps.py)."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kiln.app.results import results
from kiln.app.storage.local import LocalStore
from kiln.workers.close.steps import join_identical
from kiln.workers.models.grouping import Groups, merge


def place(tmp_path: Path) -> results.Place:
    return results.Place(LocalStore(tmp_path), "results/job/")


def groups_rows(at: results.Place) -> list[dict[str, object]]:
    return pq.read_table(io.BytesIO(at.store.get(results.groups_key(at)))).to_pylist()


def test_identical_items_alone_form_groups_of_their_own() -> None:
    identical = [("aa", "x1"), ("aa", "x2"), ("bb", "y1"), ("bb", "y2"), ("bb", "y3")]
    merged = merge(Groups([], []), identical)
    assert merged.members == [["x1", "x2"], ["y1", "y2", "y3"]]
    assert merged.similarities == [[1.0, 1.0], [1.0, 1.0, 1.0]]


def test_identical_items_join_the_family_groups_and_keep_its_order() -> None:
    found = Groups([["a", "b"], ["c", "d"]], [[1.0, 0.95], [1.0, 0.93]])
    # b and d are the same bytes: the two near-duplicate groups are one; e is a copy of a
    identical = [("11", "b"), ("11", "d"), ("22", "a"), ("22", "e")]
    merged = merge(found, identical)
    assert merged.members == [["a", "b", "c", "d", "e"]]
    assert merged.similarities == [[1.0, 0.95, 1.0, 0.93, 1.0]]  # e takes a's similarity


def test_phash_groups_keep_no_similarity() -> None:
    merged = merge(Groups([["a", "b"]], [[None, None]]), [("11", "b"), ("11", "c")])
    assert merged.members == [["a", "b", "c"]]
    assert merged.similarities == [[None, None, None]]


def test_no_identical_items_leave_the_groups_and_summary_alone(tmp_path: Path) -> None:
    summary = {"groups": {"key": "k", "groups": 1}}
    assert join_identical(place(tmp_path), [], summary) is summary
    assert not place(tmp_path).store.exists(results.groups_key(place(tmp_path)))


def test_close_writes_the_sha256_of_identical_members_and_true_counts(tmp_path: Path) -> None:
    at = place(tmp_path)
    results.write_groups(at, [["a", "b"]], [[1.0, 0.97]])
    summary = {"groups": {"key": results.groups_key(at), "threshold": 0.92, "groups": 1}}

    part = join_identical(at, [("d1", "c"), ("d1", "z")], summary)

    assert part["groups"] == {
        "key": results.groups_key(at),
        "threshold": 0.92,
        "groups": 2,
        "items_in_groups": 4,
    }
    assert part["identical"] == {"groups": 1, "items": 2}
    assert groups_rows(at) == [
        {"group": 0, "key": "a", "similarity": 1.0, "sha256": None},
        {"group": 0, "key": "b", "similarity": pytest.approx(0.97), "sha256": None},
        {"group": 1, "key": "c", "similarity": 1.0, "sha256": "d1"},
        {"group": 1, "key": "z", "similarity": 1.0, "sha256": "d1"},
    ]
