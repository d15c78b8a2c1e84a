"""`process_chunk` end to end without a broker: SQLite, a local store and a real ONNX classifier."""

from __future__ import annotations

import io
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select, update

from devstack.images import solid, truncated_jpeg
from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import TransientError
from kiln.app.db import leases
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, Model
from kiln.app.dispatch.stub import Enqueued, RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, cancel_job, submit_job
from kiln.app.results import results
from kiln.workers.chunk.run import process_chunk
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.runtime import WorkerRuntime
from tests.workers.colours import MODEL, register_colours

RED, GREEN, BLUE = (250, 5, 5), (5, 250, 5), (5, 5, 250)
# chunk 0: r, g, b; chunk 1: notes.txt (not an image), b2
FILES = [
    ("r.png", solid(RED)),
    ("g.png", solid(GREEN)),
    ("b.png", solid(BLUE)),
    ("notes.txt", b"these are not pixels"),
    ("b2.png", solid(BLUE, size=(40, 90))),
]
EXPECTED_LABEL = {"r.png": "red", "g.png": "green", "b.png": "blue", "b2.png": "blue"}


def _place(runtime: WorkerRuntime, job_id: str) -> results.Place:
    return results.Place(runtime.store, results.results_prefix(job_id))


def submit(
    runtime: WorkerRuntime, files: list[tuple[str, bytes]] = FILES
) -> tuple[str, list[Enqueued]]:
    dispatcher = RecordingDispatcher()
    request = JobRequest(
        tenant="acme", model=MODEL, uploads=[Upload(name, data) for name, data in files]
    )
    with runtime.sessions() as session:
        job = submit_job(session, runtime.store, dispatcher, runtime.settings, request).job
    return job.id, dispatcher.calls


def run_all(runtime: WorkerRuntime, calls: list[Enqueued]) -> list[ChunkReport]:
    """One run per message; the run's owner is the message, as a Celery task id would be."""
    return [
        process_chunk(runtime, c.job_id, c.chunk, c.item_ids, owner=f"msg-{c.chunk}") for c in calls
    ]


def items_by_key(runtime: WorkerRuntime, job_id: str) -> dict[str, Item]:
    with runtime.sessions() as session:
        rows = session.scalars(select(Item).where(Item.job_id == job_id).order_by(Item.id))
        return {item.key: item for item in rows}


def job_row(runtime: WorkerRuntime, job_id: str) -> Job:
    with runtime.sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def shard_rows(runtime: WorkerRuntime, job_id: str, chunk: int) -> list[dict[str, Any]]:
    table = pq.read_table(
        io.BytesIO(runtime.store.get(results.shard_key(_place(runtime, job_id), chunk)))
    )
    return list(table.to_pylist())


def manifest(runtime: WorkerRuntime, job_id: str) -> dict[str, Any]:
    return dict(json.loads(runtime.store.get(results.manifest_key(_place(runtime, job_id)))))


def test_a_job_runs_to_completion(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    assert [(c.chunk, len(c.item_ids)) for c in calls] == [(0, 3), (1, 2)]

    first = process_chunk(runtime, job_id, 0, calls[0].item_ids)
    assert (first.processed, first.succeeded, first.failed) == (3, 3, 0)
    assert first.job_status is None
    assert job_row(runtime, job_id).status == JobStatus.RUNNING
    assert not runtime.store.exists(results.manifest_key(_place(runtime, job_id)))

    second = process_chunk(runtime, job_id, 1, calls[1].item_ids)
    assert (second.processed, second.succeeded, second.failed) == (2, 1, 1)
    assert second.job_status == JobStatus.COMPLETED

    items = items_by_key(runtime, job_id)
    for key, label in EXPECTED_LABEL.items():
        item = items[key]
        assert item.status == ItemStatus.SUCCEEDED, item.error
        assert item.error is None
        assert item.attempts == 1
        assert item.outputs is not None
        labels = item.outputs["labels"]
        assert len(labels) == 2  # top_k
        assert labels[0]["label"] == label
        assert labels[0]["score"] > labels[1]["score"]
        assert item.duration_ms is not None and item.duration_ms >= 0
    bad = items["notes.txt"]
    assert bad.status == ItemStatus.FAILED
    assert bad.error == "The file is neither an image nor a video Kiln can read."
    assert bad.outputs is None

    job = job_row(runtime, job_id)
    assert job.status == JobStatus.COMPLETED  # one failed item does not fail the job
    assert job.started_at is not None and job.finished_at is not None


def test_each_chunk_writes_one_parquet_shard(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    run_all(runtime, calls)

    assert results.shard_keys(_place(runtime, job_id)) == [
        f"results/{job_id}/part-000000.parquet",
        f"results/{job_id}/part-000001.parquet",
    ]
    rows = shard_rows(runtime, job_id, 0)
    assert [r["key"] for r in rows] == ["r.png", "g.png", "b.png"]
    assert [r["labels"][0]["label"] for r in rows] == ["red", "green", "blue"]
    assert {r["status"] for r in rows} == {"succeeded"}
    by_key = {r["key"]: r for r in shard_rows(runtime, job_id, 1)}
    assert by_key["notes.txt"]["status"] == "failed"
    assert by_key["notes.txt"]["error"] == "The file is neither an image nor a video Kiln can read."
    assert by_key["notes.txt"]["labels"] is None
    assert by_key["b2.png"]["labels"][0]["label"] == "blue"

    combined = results.combined_table(_place(runtime, job_id))
    assert combined.num_rows == len(FILES)
    assert combined.column_names[:4] == ["key", "status", "error", "duration_ms"]
    assert "labels" in combined.column_names


def test_the_manifest_is_written_when_the_job_completes(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    run_all(runtime, calls)

    written = manifest(runtime, job_id)
    assert written["job_id"] == job_id
    assert written["model"] == f"{MODEL}:1"  # the version the job ran
    assert written["status"] == "completed"
    assert written["engine"]  # the backend that ran it, e.g. onnxruntime-cpu
    assert written["counts"] == {
        "total": 5, "succeeded": 4, "failed": 1, "cancelled": 0, "skipped": 0, "deleted": 0,
        "fell_back": 0, "fell_back_succeeded": 0, "known_failed": 0, "excluded": 0,
    }  # fmt: skip
    assert written["shards"] == results.shard_keys(_place(runtime, job_id))
    assert written["finished_at"] is not None


def test_the_manifest_timestamps_are_utc(runtime: WorkerRuntime) -> None:
    """Everything Kiln stores is UTC; the manifest should say so, on SQLite too."""
    job_id, calls = submit(runtime)
    run_all(runtime, calls)
    written = manifest(runtime, job_id)
    for field in ("created_at", "finished_at"):
        stamp = datetime.fromisoformat(written[field])
        assert stamp.utcoffset() is not None, f"{field} {written[field]!r} has no UTC offset"


def test_one_bad_image_fails_alone(runtime: WorkerRuntime) -> None:
    files = [("a.png", solid(RED)), ("cut.jpg", truncated_jpeg()), ("c.png", solid(GREEN))]
    job_id, calls = submit(runtime, files)
    [report] = run_all(runtime, calls)
    assert (report.succeeded, report.failed) == (2, 1)
    items = items_by_key(runtime, job_id)
    assert items["cut.jpg"].status == ItemStatus.FAILED
    assert items["cut.jpg"].error
    assert items["cut.jpg"].error.endswith(".")
    assert items["a.png"].outputs["labels"][0]["label"] == "red"  # type: ignore[index]
    assert items["c.png"].outputs["labels"][0]["label"] == "green"  # type: ignore[index]


def test_replaying_a_chunk_changes_nothing(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    run_all(runtime, calls)
    before = {
        k: (i.status, i.attempts, i.outputs, i.error)
        for k, i in items_by_key(runtime, job_id).items()
    }
    shard_before = shard_rows(runtime, job_id, 0)
    manifest_before = runtime.store.get(results.manifest_key(_place(runtime, job_id)))

    replay = process_chunk(runtime, job_id, 0, calls[0].item_ids)  # a redelivered message

    assert replay.processed == 0
    assert replay.job_status is None  # the job was already closed
    after = {
        k: (i.status, i.attempts, i.outputs, i.error)
        for k, i in items_by_key(runtime, job_id).items()
    }
    assert after == before
    assert shard_rows(runtime, job_id, 0) == shard_before
    assert runtime.store.get(results.manifest_key(_place(runtime, job_id))) == manifest_before
    assert job_row(runtime, job_id).status == JobStatus.COMPLETED


def test_replaying_a_chunk_on_a_fresh_worker_keeps_the_shard(
    runtime: WorkerRuntime, settings: Settings
) -> None:
    """A chunk redelivered to another worker process (acks_late after a crash) is harmless.

    The new process has not loaded the model, since nothing is left to run; the rewritten
    shard must still carry the model's output columns.
    """
    job_id, calls = submit(runtime)
    run_all(runtime, calls)
    shard_before = shard_rows(runtime, job_id, 0)

    fresh = WorkerRuntime(settings)
    try:
        replay = process_chunk(fresh, job_id, 0, calls[0].item_ids)
    finally:
        fresh.close()

    assert replay.processed == 0
    assert shard_rows(runtime, job_id, 0) == shard_before


def test_a_chunk_of_a_cancelled_job_processes_nothing(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    with runtime.sessions() as session:
        assert cancel_job(session, "acme", job_id).status == JobStatus.CANCELLED

    reports = run_all(runtime, calls)

    assert [r.processed for r in reports] == [0, 0]
    assert [r.job_status for r in reports] == [None, None]
    items = items_by_key(runtime, job_id)
    assert {i.status for i in items.values()} == {ItemStatus.CANCELLED}
    assert {i.attempts for i in items.values()} == {0}
    assert job_row(runtime, job_id).status == JobStatus.CANCELLED


def test_a_chunk_leased_before_a_cancel_cancels_what_no_batch_took(
    runtime: WorkerRuntime,
) -> None:
    """A worker has leased chunk 0 when the cancel arrives, but no batch has its rows yet: the
    run cancels them rather than starting them, and chunk 1 never runs."""
    job_id, calls = submit(runtime)
    first = calls[0]
    with runtime.sessions() as session:
        leases.take(session, job_id, first.item_ids, "msg-0", 60)
        session.commit()
        assert cancel_job(session, "acme", job_id).status == JobStatus.CANCELLING

    reports = run_all(runtime, calls)

    assert reports[0].processed == 0 and reports[1].processed == 0
    assert JobStatus.CANCELLED in {r.job_status for r in reports}
    items = items_by_key(runtime, job_id)
    assert {item.status for item in items.values()} == {ItemStatus.CANCELLED}
    assert items["r.png"].error == "The job was cancelled."
    assert job_row(runtime, job_id).status == JobStatus.CANCELLED
    assert manifest(runtime, job_id)["status"] == "cancelled"
    assert manifest(runtime, job_id)["counts"]["cancelled"] == len(items)


def test_a_chunk_of_a_deleted_job_is_dropped(runtime: WorkerRuntime) -> None:
    report = process_chunk(runtime, "00000000-0000-0000-0000-000000000000", 0, [1, 2])
    assert report.processed == 0 and report.job_status is None


def test_a_model_that_cannot_load_fails_its_items(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime, [("a.png", solid(RED))])
    with runtime.sessions() as session:
        onnx_key = session.scalars(select(Model.onnx_key)).one()
    runtime.store.put(onnx_key, b"tampered")  # no longer matches the recorded sha256

    [report] = run_all(runtime, calls)

    assert report.job_status == JobStatus.COMPLETED
    item = items_by_key(runtime, job_id)["a.png"]
    assert item.status == ItemStatus.FAILED
    assert item.error is not None
    assert item.error.startswith(f"Model '{MODEL}:1' could not be loaded:")


def test_a_chunk_shard_lost_before_the_job_closed_is_rewritten(runtime: WorkerRuntime) -> None:
    """Chunk 0's results reached the database but its shard did not reach storage (a crash
    between the two, or a lost object). The chunk that closes the job writes it from the
    database first, so whoever sees `completed` can read every row."""
    job_id, calls = submit(runtime)
    process_chunk(runtime, job_id, 0, calls[0].item_ids)
    runtime.store.delete(results.shard_key(_place(runtime, job_id), 0))

    done = process_chunk(runtime, job_id, 1, calls[1].item_ids)

    assert done.job_status == JobStatus.COMPLETED
    assert results.combined_table(_place(runtime, job_id)).num_rows == len(FILES)
    assert manifest(runtime, job_id)["shards"] == results.shard_keys(_place(runtime, job_id))
    assert shard_rows(runtime, job_id, 0)[0]["labels"][0]["label"] == "red"


def test_results_commit_only_after_the_shard_is_written(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage fails while the shard is written: no result is committed, the run hands its
    lease back, and the retried chunk runs the items again."""
    job_id, calls = submit(runtime, FILES[:2])

    def down(*_args: Any, **_kwargs: Any) -> None:
        raise TransientError("S3 is unreachable.")

    with monkeypatch.context() as patch:
        patch.setattr(results, "write_table", down)
        with pytest.raises(TransientError):
            process_chunk(runtime, job_id, 0, calls[0].item_ids)
    items = items_by_key(runtime, job_id).values()
    assert {(i.status, i.lease_owner) for i in items} == {(ItemStatus.PENDING, None)}

    retry = process_chunk(runtime, job_id, 0, calls[0].item_ids)

    assert retry.job_status == JobStatus.COMPLETED
    assert {i.attempts for i in items_by_key(runtime, job_id).values()} == {2}
    assert len(shard_rows(runtime, job_id, 0)) == 2


def test_a_failed_manifest_write_is_healed_by_the_retry(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Storage throttles (or the worker dies) after the job is closed but before the manifest
    is written; the task retries (or, with acks_late, the message is redelivered), and the
    replay must still produce the manifest."""
    job_id, calls = submit(runtime)
    process_chunk(runtime, job_id, 0, calls[0].item_ids)

    def throttled(*_args: Any) -> None:
        raise TransientError("S3 is throttling requests; retry shortly.")

    with monkeypatch.context() as patch:
        patch.setattr(results, "write_manifest", throttled)
        with pytest.raises(TransientError):
            process_chunk(runtime, job_id, 1, calls[1].item_ids)
    assert job_row(runtime, job_id).status == JobStatus.COMPLETED

    process_chunk(runtime, job_id, 1, calls[1].item_ids)  # the redelivered message

    assert runtime.store.exists(results.manifest_key(_place(runtime, job_id)))


# --- content cache -------------------------------------------------------------------------


def engine_rows(runtime: WorkerRuntime) -> int:
    return sum(s.rows for s in runtime.batch_stats().values())


def test_an_input_seen_before_is_not_run_again(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    run_all(runtime, calls)
    ran = engine_rows(runtime)

    renamed = [(f"again-{name}", data) for name, data in FILES]
    again_id, again_calls = submit(runtime, renamed)
    reports = run_all(runtime, again_calls)

    assert sum(r.cached for r in reports) == 4  # the 4 images; the text file fails again
    assert engine_rows(runtime) == ran  # the engine saw nothing new
    first, second = items_by_key(runtime, job_id), items_by_key(runtime, again_id)
    for name, _data in FILES:
        assert second[f"again-{name}"].status == first[name].status
        assert second[f"again-{name}"].outputs == first[name].outputs
    assert (
        shard_rows(runtime, again_id, 0)[0]["labels"] == shard_rows(runtime, job_id, 0)[0]["labels"]
    )


def test_the_same_bytes_twice_in_one_job_are_run_once_per_chunk_at_most(
    runtime: WorkerRuntime,
) -> None:
    red = solid(RED)
    job_id, calls = submit(runtime, [("a.png", red), ("b.png", red), ("c.png", red)])
    [report] = run_all(runtime, calls)
    assert report.succeeded == 3
    labels = {k: i.outputs["labels"][0]["label"] for k, i in items_by_key(runtime, job_id).items()}  # type: ignore[index]
    assert set(labels.values()) == {"red"}


def test_another_spec_of_the_model_does_not_reuse_results(
    runtime: WorkerRuntime, tmp_path: Path
) -> None:
    _job_id, calls = submit(runtime, FILES[:1])
    run_all(runtime, calls)
    register_colours(runtime, tmp_path)  # version 2: the same weights, with another spec below
    with runtime.sessions() as session:
        session.execute(
            update(Model)
            .where(Model.version == 2)
            .values(
                spec={
                    **session.scalars(select(Model.spec).where(Model.version == 2)).one(),
                    "top_k": 1,
                }
            )
        )
        session.commit()
    _job_id, calls = submit(runtime, [("again.png", FILES[0][1])])
    [report] = run_all(runtime, calls)
    assert report.cached == 0 and report.succeeded == 1


def test_the_cache_can_be_turned_off(settings: Settings, tmp_path: Path) -> None:
    runtime = WorkerRuntime(settings.model_copy(update={"content_cache": False}))
    try:
        register_colours(runtime, tmp_path)
        for _ in range(2):
            _job_id, calls = submit(runtime, FILES[:1])
            [report] = run_all(runtime, calls)
            assert report.cached == 0
        assert engine_rows(runtime) == 2
    finally:
        runtime.close()


def test_every_row_keeps_its_input_sha256_and_identical_inputs_are_grouped(
    runtime: WorkerRuntime,
) -> None:
    """Any model: the results carry each input's sha256, and byte-identical inputs form
    groups (groups.parquet, the results' `group` column, the manifest)."""
    red, blue = solid(RED), solid(BLUE)
    files = [("a.png", red), ("b.png", blue), ("c.png", red), ("d.png", solid(GREEN))]
    job_id, calls = submit(runtime, [*files, ("e.txt", b"not pixels"), ("f.txt", b"not pixels")])
    run_all(runtime, calls)

    items = items_by_key(runtime, job_id)
    assert items["a.png"].sha256 == items["c.png"].sha256 == sha256_hex(red)
    assert items["b.png"].sha256 == sha256_hex(blue)
    table = results.combined_table(_place(runtime, job_id)).to_pylist()
    by_key = {row["key"]: row for row in table}
    assert by_key["a.png"]["sha256"] == sha256_hex(red)
    assert by_key["a.png"]["group"] == by_key["c.png"]["group"] == 0
    assert by_key["e.txt"]["group"] == by_key["f.txt"]["group"] == 1  # failed, but the same bytes
    assert by_key["b.png"]["group"] is None and by_key["d.png"]["group"] is None
    summary = manifest(runtime, job_id)
    assert summary["identical"] == {"groups": 2, "items": 4}
    assert summary["groups"]["groups"] == 2


def test_an_interactive_items_stages_are_recorded_and_a_bulk_items_are_not(
    runtime: WorkerRuntime,
) -> None:
    job_id, calls = submit(runtime)
    first, second = calls
    process_chunk(runtime, job_id, first.chunk, first.item_ids, urgent=True, owner="m0")
    process_chunk(runtime, job_id, second.chunk, second.item_ids, owner="m1")
    items = items_by_key(runtime, job_id)
    stages = items["r.png"].stages_ms
    assert stages is not None and set(stages) == {"fetch", "decode", "engine", "post"}
    assert all(ms >= 0 for ms in stages.values())
    assert sum(stages.values()) <= (items["r.png"].duration_ms or 0) + 1  # within its total
    assert items["b2.png"].stages_ms is None  # not urgent: no column per bulk row
