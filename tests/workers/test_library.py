"""A pipeline's library (workers/models/library.py): runs fold their rows in, deletions and changed
objects leave, and a run's groups cover every object the pipeline has processed."""

from __future__ import annotations

from pathlib import Path

from kiln.app.results import results
from kiln.app.results.results import Place, ResultRow
from kiln.app.storage.local import LocalStore
from kiln.workers.models import phash
from kiln.workers.models.library import Library, library_place, update


def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path)


def run(at: LocalStore, job: str, rows: list[tuple[str, str | None, str | None]]) -> Place:
    """A closed run's place with one shard: (key, phash or None for a failed item, sha256)."""
    place = Place(at, results.results_prefix(job))
    written = [
        ResultRow(key, "succeeded", None, 1.0, {"phash": h}, digest)
        if h
        else ResultRow(key, "failed", "The file is empty.", 1.0, None, digest)
        for key, h, digest in rows
    ]
    results.write_shard(place, 0, written, phash.FIELDS)
    return place


def contents(library: Library) -> dict[str, tuple[str | None, str | None]]:
    rows = library.table.to_pylist()
    return {r["key"]: (r["phash"], r["sha256"]) for r in rows}


def test_runs_fold_into_the_library(tmp_path: Path) -> None:
    at = store(tmp_path)
    where = library_place(at, 7, "phash")
    first = update(where, run(at, "j1", [("a", "ff00", "d1"), ("b", "0f0f", "d2")]), ["phash"])
    assert contents(first) == {"a": ("ff00", "d1"), "b": ("0f0f", "d2")}
    assert (first.added, first.gone) == (2, frozenset())

    # the next run: c is new, b changed (new hash), a was skipped (unchanged: not an item)
    second = update(where, run(at, "j2", [("c", "00ff", "d3"), ("b", "1111", "d4")]), ["phash"])
    assert contents(second) == {"a": ("ff00", "d1"), "b": ("1111", "d4"), "c": ("00ff", "d3")}
    assert (second.added, second.gone) == (2, frozenset({"b"}))
    assert second.summary() == {"key": where.key("library.parquet"), "objects": 3, "added": 2}


def test_deleted_objects_and_objects_that_now_fail_leave_the_library(tmp_path: Path) -> None:
    at = store(tmp_path)
    where = library_place(at, 7, "phash")
    update(
        where,
        run(at, "j1", [("a", "ff00", "d1"), ("b", "0f0f", "d2"), ("c", "1", "d3")]),
        ["phash"],
    )
    rerun = run(at, "j2", [("b", None, "d5")])  # b changed and no longer decodes
    results.write_keys(rerun, "deleted.parquet", ["c"])
    after = update(where, rerun, ["phash"])
    assert contents(after) == {"a": ("ff00", "d1")}
    assert after.gone == frozenset({"b", "c"})


def test_a_replayed_close_changes_nothing(tmp_path: Path) -> None:
    at = store(tmp_path)
    where = library_place(at, 7, "phash")
    place = run(at, "j1", [("a", "ff00", "d1")])
    update(where, place, ["phash"])
    assert contents(update(where, place, ["phash"])) == {"a": ("ff00", "d1")}


def test_each_model_version_has_its_own_library(tmp_path: Path) -> None:
    at = store(tmp_path)
    assert library_place(at, 7, "embed:2").prefix == "pipelines/7/embed@2/"
    assert library_place(at, 7, "embed:3") != library_place(at, 7, "embed:2")


def test_identical_objects_across_runs(tmp_path: Path) -> None:
    at = store(tmp_path)
    where = library_place(at, 7, "phash")
    update(where, run(at, "j1", [("a", "ff00", "d1"), ("b", "0f0f", "d2")]), ["phash"])
    later = update(where, run(at, "j2", [("copy-of-a", "ff00", "d1")]), ["phash"])
    assert later.identical() == [("d1", "a"), ("d1", "copy-of-a")]
