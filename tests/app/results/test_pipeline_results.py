"""A pipeline's current results: one row per live object, the newest run's, from the runs'
shards (the latest row per key, in memory and streamed from a store)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.app.core.errors import ConflictError
from kiln.app.results import results
from kiln.app.results.pipeline_results import Claims, Run, latest_rows, plan, stream
from kiln.app.results.results import Place, ResultRow
from kiln.app.storage.local import LocalStore

PHASH = [pa.field("phash", pa.string())]


def row(
    key: str, status: str = "succeeded", value: str | None = None, t: float | None = None
) -> ResultRow:
    """A result row: its phash `value` (a failure has none, and an error), a frame at `t`."""
    failed = status == "failed"
    return ResultRow(
        key=f"{key}#t={t:.3f}" if t is not None else key,
        status=status,
        error="The file is not an image." if failed else None,
        duration_ms=1.0,
        outputs=None if failed or status == "cancelled" else {"phash": value or key},
        frame_time_s=t,
    )


def shard(*rows: ResultRow, fields: Sequence[pa.Field] = PHASH) -> pa.Table:
    return results.items_table(rows, fields)


def current(
    runs: list[tuple[str, list[pa.Table]]], live: set[str]
) -> dict[str, tuple[str, str | None, str]]:
    """key → (status, phash, job_id) of the current rows, each key once."""
    table = latest_rows(runs, live)
    rows = table.to_pylist()
    assert len(rows) == len({r["key"] for r in rows}), "a key twice"
    return {r["key"]: (r["status"], r["phash"], r["job_id"]) for r in rows}


def test_a_rerun_leaves_one_row_per_live_object_its_latest() -> None:
    first = ("run-1", [shard(row("a"), row("b"), row("c")), shard(row("d"), row("x", "failed"))])
    rerun = ("run-2", [shard(row("b", value="b2"), row("e"), row("c", "failed"))])
    live = {"a", "b", "c", "e", "x"}  # d was deleted; x failed and is unchanged since

    assert current([rerun, first], live) == {
        "a": ("succeeded", "a", "run-1"),  # unchanged: skipped by the rerun
        "b": ("succeeded", "b2", "run-2"),  # changed: the new row only
        "c": ("failed", None, "run-2"),  # changed, and fails now: no stale success
        "e": ("succeeded", "e", "run-2"),  # added
        "x": ("failed", None, "run-1"),  # a known failure, once
    }


def test_a_failure_rerun_every_night_is_one_row_the_newest() -> None:
    runs = [(f"run-{n}", [shard(row("x", "failed"), row(f"new-{n}"))]) for n in (3, 2, 1)]
    got = current(runs, {"x", "new-1", "new-2", "new-3"})
    assert got["x"] == ("failed", None, "run-3")
    assert len(got) == 4


def test_a_cancelled_item_was_not_processed_the_older_row_stands() -> None:
    first = ("run-1", [shard(row("a"), row("b"))])
    cancelled = ("run-2", [shard(row("a", "cancelled"), row("b", value="b2"))])
    assert current([cancelled, first], {"a", "b"}) == {
        "a": ("succeeded", "a", "run-1"),
        "b": ("succeeded", "b2", "run-2"),
    }


def test_a_live_object_no_run_has_finished_has_no_row() -> None:
    assert current([("run-1", [shard(row("a"))])], {"a", "new"}) == {
        "a": ("succeeded", "a", "run-1")
    }


def test_a_redone_video_keeps_the_new_runs_frames_only_across_its_shards() -> None:
    old = ("run-1", [shard(*(row("v.mp4", t=t) for t in (0.0, 1.0, 2.0)), row("a"))])
    # a shorter new cut, its frames in two chunks of the rerun
    new = (
        "run-2",
        [shard(row("v.mp4", value="n0", t=0.0)), shard(row("v.mp4", value="n1", t=1.0))],
    )
    assert current([new, old], {"v.mp4", "a"}) == {
        "v.mp4#t=0.000": ("succeeded", "n0", "run-2"),
        "v.mp4#t=1.000": ("succeeded", "n1", "run-2"),
        "a": ("succeeded", "a", "run-1"),
    }


def test_a_deleted_videos_frames_are_gone() -> None:
    runs = [("run-1", [shard(row("v.mp4", t=0.0), row("a"))])]
    assert set(current(runs, {"a"})) == {"a"}


def test_a_shard_from_before_the_source_column_goes_by_key() -> None:
    old = shard(row("a"), row("b")).drop_columns(["source"])
    got = latest_rows([("run-2", [shard(row("a", value="a2"))]), ("run-1", [old])], {"a", "b"})
    assert sorted(got.column("key").to_pylist()) == ["a", "b"]
    assert got.schema.field("source").type == pa.string()


def test_no_run_gives_an_empty_table_with_the_columns() -> None:
    table = latest_rows([], {"a"})
    assert table.num_rows == 0
    assert [f.name for f in results.BASE_FIELDS] + ["job_id"] == table.column_names


def test_claims_settle_when_every_live_object_is_claimed() -> None:
    claims = Claims({"a", "b"})
    assert claims.claim([{"a", "gone"}, {"a"}]) == [frozenset({"a"}), frozenset({"a"})]
    assert not claims.settled
    assert claims.claim([{"a", "b"}]) == [frozenset({"b"})]  # a is the newer run's
    assert claims.settled


# -- streamed from a store: the same rows, one shard in memory at a time --


def write_run(store: LocalStore, job_id: str, shards: list[pa.Table]) -> Run:
    place = Place(store, results.results_prefix(job_id))
    for chunk, table in enumerate(shards):
        results.write_table(place, chunk, table)
    return Run(job_id, place)


def streamed(runs: list[Run], live: set[str]) -> pa.Table:
    return pq.read_table(io.BytesIO(b"".join(stream(plan(runs, live)))))


def test_streamed_results_are_the_latest_rows(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    fallback = [*PHASH, pa.field("labels", pa.list_(pa.string()))]  # a run with more columns
    first = [shard(row("a"), row("b"), row("c")), shard(row("d"), row("x", "failed"))]
    rerun = [shard(row("b", value="b2"), row("e"), fields=fallback), shard(row("c", "failed"))]
    live = {"a", "b", "c", "e", "x"}
    runs = [write_run(store, "run-2", rerun), write_run(store, "run-1", first)]

    got = streamed(runs, live)
    expected = latest_rows([("run-2", rerun), ("run-1", first)], live)
    assert got.schema == expected.schema
    assert "labels" in got.column_names and got.column_names[-1] == "job_id"
    assert sorted(got.to_pylist(), key=str) == sorted(expected.to_pylist(), key=str)
    assert got.num_rows == len(live)


def test_older_runs_are_not_read_once_every_object_is_claimed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    old = write_run(store, "run-1", [shard(row("a"))])
    store.put(results.shard_key(old.place, 0), b"not parquet")  # would raise if read
    new = write_run(store, "run-2", [shard(row("a", value="a2"))])
    current = plan([new, old], {"a"})
    assert [take.job_id for take in current.takes] == ["run-2"]
    with pytest.raises(ConflictError, match="The results of run run-1 cannot be read"):
        plan([old], {"a"})  # before anything is streamed
