"""Results as Parquet: one shard per chunk, read back as one table."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.app.db.models import ItemStatus
from kiln.app.results.results import (
    BASE_FIELDS,
    Place,
    combined_table,
    items_table,
    manifest_key,
    results_prefix,
    shard_key,
    shard_keys,
    shards_by_chunk,
    stream_parquet,
    write_groups,
    write_manifest,
    write_shard,
)
from kiln.app.storage.local import LocalStore


@dataclass
class FakeItem:
    """Stands in for `app.db.models.Item`: only the attributes `items_table` reads."""

    key: str
    status: str
    error: str | None = None
    duration_ms: float | None = None
    outputs: dict[str, Any] | None = None
    sha256: str | None = None
    answered_by: str | None = None
    fallback_reason: str | None = None
    frame_index: int | None = None
    frame_time_s: float | None = None


# Every row's columns, whatever the model: the item, then which model answered it and why not
# the job's own (a fallback's answer).
BASE = [
    "key", "status", "error", "duration_ms", "sha256", "answered_by", "fallback_reason",
    "source", "frame_index", "frame_time_s",
]  # fmt: skip
LABEL = pa.struct([("label", pa.string()), ("score", pa.float32())])
LABEL_FIELDS = [pa.field("labels", pa.list_(LABEL))]
DETECTION = pa.struct(
    [("label", pa.string()), ("score", pa.float32()), ("box", pa.list_(pa.float32(), 4))]
)
DETECTION_FIELDS = [pa.field("detections", pa.list_(DETECTION))]


def classified(key: str, label: str = "cat") -> FakeItem:
    return FakeItem(
        key,
        ItemStatus.SUCCEEDED,
        duration_ms=12.5,
        outputs={"labels": [{"label": label, "score": 0.75}], "ignored": 1},
        answered_by="classifier:1",
    )


def failed(key: str) -> FakeItem:
    return FakeItem(key, ItemStatus.FAILED, error="The file is empty.", duration_ms=1.0)


def detected(key: str) -> FakeItem:
    box = [1.0, 2.0, 3.0, 4.0]
    return FakeItem(
        key,
        ItemStatus.SUCCEEDED,
        duration_ms=30.0,
        outputs={"detections": [{"label": "FACE_MALE", "score": 0.5, "box": box}]},
    )


def test_items_table_columns_and_rows() -> None:
    table = items_table([classified("a.jpg"), failed("b.jpg")], LABEL_FIELDS)
    assert table.column_names == [*BASE, "labels"]
    assert table.schema == pa.schema([*BASE_FIELDS, *LABEL_FIELDS])
    assert table.to_pylist() == [
        {
            "key": "a.jpg",
            "status": "succeeded",
            "error": None,
            "duration_ms": 12.5,
            "sha256": None,
            "answered_by": "classifier:1",
            "fallback_reason": None,
            "source": "a.jpg",
            "frame_index": None,
            "frame_time_s": None,
            "labels": [{"label": "cat", "score": 0.75}],
        },
        {
            "key": "b.jpg",
            "status": "failed",
            "error": "The file is empty.",
            "duration_ms": 1.0,
            "sha256": None,
            "answered_by": None,
            "fallback_reason": None,
            "source": "b.jpg",
            "frame_index": None,
            "frame_time_s": None,
            "labels": None,
        },
    ]


def test_items_table_without_output_fields() -> None:
    table = items_table([failed("x")], [])
    assert table.column_names == BASE
    assert table.num_rows == 1


def test_items_table_empty() -> None:
    table = items_table([], LABEL_FIELDS)
    assert table.num_rows == 0
    assert table.column_names == [*BASE, "labels"]


def test_items_table_missing_output_is_null() -> None:
    item = FakeItem("c", ItemStatus.SUCCEEDED, outputs={"other": 1})
    assert items_table([item], LABEL_FIELDS).column("labels").to_pylist() == [None]


def P(store: LocalStore, job_id: str) -> Place:
    return Place(store, results_prefix(job_id))


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


def test_write_shard_writes_parquet_at_the_chunk_key(store: LocalStore) -> None:
    key = write_shard(P(store, "job1"), 3, [classified("a"), failed("b")], LABEL_FIELDS)
    assert key == shard_key(P(store, "job1"), 3) == "results/job1/part-000003.parquet"
    table = pq.read_table(io.BytesIO(store.get(key)))
    assert table.column("key").to_pylist() == ["a", "b"]
    assert table.column("labels").to_pylist() == [[{"label": "cat", "score": 0.75}], None]


def test_combined_table_across_shards_with_different_fields(store: LocalStore) -> None:
    write_shard(P(store, "job1"), 0, [classified("a"), failed("b")], LABEL_FIELDS)
    write_shard(P(store, "job1"), 1, [detected("c"), failed("d")], DETECTION_FIELDS)
    write_shard(P(store, "other-job"), 0, [classified("z")], LABEL_FIELDS)
    store.put(manifest_key(P(store, "job1")), b"{}")  # not a shard

    table = combined_table(P(store, "job1"))
    assert table.num_rows == 4
    assert set(table.column_names) == {*BASE, "labels", "detections"}
    rows = {row["key"]: row for row in table.to_pylist()}
    assert sorted(rows) == ["a", "b", "c", "d"]
    assert rows["a"]["labels"] == [{"label": "cat", "score": 0.75}]
    assert rows["a"]["detections"] is None
    assert rows["c"]["labels"] is None
    assert rows["c"]["detections"] == [
        {"label": "FACE_MALE", "score": 0.5, "box": [1.0, 2.0, 3.0, 4.0]}
    ]
    assert rows["b"]["status"] == rows["d"]["status"] == "failed"
    assert rows["d"]["error"] == "The file is empty."


def test_combined_table_is_the_streamed_file_read_back(store: LocalStore) -> None:
    """Joined in memory, the table is what the streamed Parquet file reads back as, chunk for
    chunk (one a shard), and written out it makes the same file byte for byte."""
    write_shard(P(store, "job1"), 0, [classified("a"), failed("b")], LABEL_FIELDS)
    write_shard(P(store, "job1"), 1, [detected("c")], DETECTION_FIELDS)
    write_shard(P(store, "job1"), 2, [failed("d")], [])
    write_groups(P(store, "job1"), [["a", "c"]])
    streamed = pq.read_table(io.BytesIO(b"".join(stream_parquet(P(store, "job1")))))
    table = combined_table(P(store, "job1"))
    assert table.schema == streamed.schema and table.equals(streamed)
    assert [c.num_chunks for c in table.columns] == [c.num_chunks for c in streamed.columns]

    def written(t: pa.Table) -> bytes:
        sink = io.BytesIO()
        pq.write_table(t, sink)
        return sink.getvalue()

    assert written(table) == written(streamed)


def test_redelivered_chunk_overwrites_its_shard(store: LocalStore) -> None:
    write_shard(P(store, "job1"), 0, [classified("a", "cat")], LABEL_FIELDS)
    write_shard(P(store, "job1"), 0, [classified("a", "dog")], LABEL_FIELDS)
    table = combined_table(P(store, "job1"))
    assert table.num_rows == 1
    assert table.column("labels").to_pylist() == [[{"label": "dog", "score": 0.75}]]


def test_combined_table_of_a_job_without_shards(store: LocalStore) -> None:
    table = combined_table(P(store, "nothing"))
    assert table.num_rows == 0
    assert table.column_names == BASE


def test_manifest_lists_the_shards(store: LocalStore) -> None:
    write_shard(P(store, "job1"), 1, [failed("b")], [])
    write_shard(P(store, "job1"), 0, [failed("a")], [])
    write_manifest(P(store, "job1"), {"job_id": "job1", "shards": ["stale"]})
    manifest = json.loads(store.get(manifest_key(P(store, "job1"))))
    assert manifest == {
        "job_id": "job1",
        "shards": ["results/job1/part-000000.parquet", "results/job1/part-000001.parquet"],
    }
    assert shard_keys(P(store, "job1")) == manifest["shards"]


def test_groups_join_the_combined_results_in_order(store: LocalStore) -> None:
    write_shard(
        P(store, "job1"), 0, [classified("a"), classified("b"), classified("c")], LABEL_FIELDS
    )
    write_shard(P(store, "job1"), 1, [classified("d")], LABEL_FIELDS)
    assert write_groups(P(store, "job1"), [["a", "d"]]) == "results/job1/groups.parquet"
    table = combined_table(P(store, "job1"))
    assert table.column("key").to_pylist() == ["a", "b", "c", "d"]
    assert table.column("group").to_pylist() == [0, None, None, 0]
    assert shard_keys(P(store, "job1")) == [
        shard_key(P(store, "job1"), 0),
        shard_key(P(store, "job1"), 1),
    ]


def test_shards_are_listed_by_the_chunk_each_holds(store: LocalStore) -> None:
    place = P(store, "job1")
    for chunk in (0, 12, 1_000_000):  # a chunk number past six digits reads back too
        write_shard(place, chunk, [classified(f"k{chunk}")], LABEL_FIELDS)
    store.put(place.key("part-notes.parquet"), b"", "application/octet-stream")  # not a shard's

    assert shards_by_chunk(place) == {c: shard_key(place, c) for c in (0, 12, 1_000_000)}
    assert shards_by_chunk(P(store, "job2")) == {}


def test_results_stream_shard_by_shard(store: LocalStore) -> None:
    """One piece per shard, then the footer: the API never holds more than one shard."""
    for chunk in range(20):
        rows = [classified(f"k{chunk}-{i}") for i in range(5)]
        write_shard(P(store, "big"), chunk, rows, LABEL_FIELDS)

    pieces = list(stream_parquet(P(store, "big")))

    assert len(pieces) == 21 and all(pieces)
    table = pq.read_table(io.BytesIO(b"".join(pieces)))
    assert table.num_rows == 100
    assert table.column("key").to_pylist()[:2] == ["k0-0", "k0-1"]
    assert table.column("labels").to_pylist()[0] == [{"label": "cat", "score": 0.75}]


def test_results_of_a_job_without_shards_stream_as_an_empty_file(store: LocalStore) -> None:
    table = pq.read_table(io.BytesIO(b"".join(stream_parquet(P(store, "none")))))
    assert table.num_rows == 0
    assert table.column_names == BASE


def test_a_video_frame_row_names_its_video_and_moment() -> None:
    frame = FakeItem(
        "clip.mp4#t=12.500", "succeeded", outputs={}, frame_index=375, frame_time_s=12.5
    )
    row = items_table([frame], []).to_pylist()[0]
    assert (row["source"], row["frame_index"], row["frame_time_s"]) == ("clip.mp4", 375, 12.5)
