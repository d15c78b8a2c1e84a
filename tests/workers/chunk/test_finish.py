"""A chunk's write, the job's close and the manifest on their own: results handed in as rows
(no engine runs), SQLite and a local store, the `colours` model (tests/workers/conftest.py).

A chunk's shard is written before its results commit; the chunk that finds nothing open closes
the job and writes the manifest; a replay heals a missing manifest or shard.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from sqlalchemy import update

from kiln.app.db import queries
from kiln.app.db.models import Ingest, Item, ItemStatus, JobStatus, utcnow
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import cancel_job
from kiln.app.results import results
from kiln.workers.chunk import lease as leasing
from kiln.workers.chunk.rows import ChunkRows, Piece
from kiln.workers.chunk.write import Written, write_chunk
from kiln.workers.close.close import ClosingJob, close_after_chunk, close_closed_job, close_job
from kiln.workers.close.fallback import shard_fields
from kiln.workers.close.lease import Lease
from kiln.workers.jobs.periodic import reconcile
from kiln.workers.models.loader import output_fields
from kiln.workers.runtime import WorkerRuntime
from tests.workers.chunk.test_run import FILES, items_by_key, job_row, shard_rows, submit

LEASE_S = 60.0


def take(
    runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int], owner: str = "run-a"
) -> Lease:
    """What `process_chunk` learns when it leases a chunk."""
    lease = leasing.take(runtime, job_id, chunk, item_ids, owner)
    assert lease is not None
    return lease


def finish_chunk(runtime: WorkerRuntime, lease: Lease, rows: ChunkRows) -> str | None:
    """The end of `process_chunk`: write, then close if this chunk was the job's last."""
    fields = shard_fields(lease.model, lease.fallback)
    wrote = write_chunk(runtime, lease, rows, fields)
    if wrote is None or not wrote.ended:
        return None
    models = runtime.models
    return close_after_chunk(runtime.sessions, runtime.store, models, lease, wrote.shard, fields)


RED = {"labels": [{"label": "red", "score": 0.9}, {"label": "dark", "score": 0.1}]}


def red(lease: Lease, failed: dict[str, str] | None = None, sha256: str | None = None) -> ChunkRows:
    """Every leased item classified `red` (but those `failed` names, with their sentence)."""
    rows = ChunkRows(lease.items)
    rows.seconds[:, 0] = 0.005  # 5 ms each
    ok = []
    for i, item in enumerate(lease.items):
        rows.sha256[i] = sha256
        if failed and item.key in failed:
            rows.fail(i, failed[item.key])
        else:
            ok.append(i)
    fields = output_fields(lease.model)
    rows.answer(Piece.of_outputs(np.asarray(ok, int), [RED] * len(ok), fields, lease.model))
    return rows


def manifest(runtime: WorkerRuntime, lease: Lease) -> dict[str, Any] | None:
    key = results.manifest_key(lease.place)
    return json.loads(runtime.store.get(key)) if runtime.store.exists(key) else None


def test_the_last_chunk_to_finish_closes_the_job(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)  # chunks of 3 and 2
    first, last = (take(runtime, job_id, c.chunk, c.item_ids) for c in calls)

    assert finish_chunk(runtime, last, red(last)) is None  # chunk 0 is still running
    assert job_row(runtime, job_id).status == JobStatus.RUNNING
    assert manifest(runtime, first) is None

    assert finish_chunk(runtime, first, red(first)) == JobStatus.COMPLETED

    job = job_row(runtime, job_id)
    assert job.status == JobStatus.COMPLETED and job.finished_at is not None
    written = manifest(runtime, first)
    assert written is not None
    assert written["status"] == "completed"
    assert written["counts"]["total"] == written["counts"]["succeeded"] == len(FILES)
    assert written["shards"] == [
        results.shard_key(first.place, 0),
        results.shard_key(first.place, 1),
    ]
    assert written["engine"] is None  # no engine ran in this process
    assert written["error"] is None and written["seconds"] is not None


def test_the_write_tells_whether_its_commit_left_anything_of_the_job_open(
    runtime: WorkerRuntime,
) -> None:
    job_id, calls = submit(runtime)  # chunks of 3 and 2
    first, last = (take(runtime, job_id, c.chunk, c.item_ids) for c in calls)
    fields = shard_fields(first.model, None)

    assert write_chunk(runtime, last, red(last), fields) == Written(shard=True, ended=False)
    assert write_chunk(runtime, first, red(first), fields) == Written(shard=True, ended=True)
    assert job_row(runtime, job_id).status == JobStatus.RUNNING  # the write closes nothing


def test_results_reach_the_database_and_the_shard(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime, FILES[:2])
    lease = take(runtime, job_id, 0, calls[0].item_ids)
    rows = red(lease, failed={"g.png": "Not a colour."})

    assert finish_chunk(runtime, lease, rows) == JobStatus.COMPLETED

    items = items_by_key(runtime, job_id)
    assert items["r.png"].status == ItemStatus.SUCCEEDED
    assert items["r.png"].outputs == RED
    assert items["r.png"].duration_ms == 5.0
    assert (items["g.png"].status, items["g.png"].error) == (ItemStatus.FAILED, "Not a colour.")
    shard = shard_rows(runtime, job_id, 0)
    assert [(r["key"], r["status"]) for r in shard] == [("r.png", "succeeded"), ("g.png", "failed")]
    assert shard[0]["labels"][0] == {"label": "red", "score": pytest.approx(0.9)}


def test_a_run_that_lost_its_lease_writes_nothing(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime, FILES[:2])
    stale = take(runtime, job_id, 0, calls[0].item_ids, owner="run-a")
    with runtime.sessions() as session:  # run-a's lease ran out; run-b took the items
        session.execute(update(Item).where(Item.job_id == job_id).values(lease_expires_at=utcnow()))
        session.commit()
    take(runtime, job_id, 0, calls[0].item_ids, owner="run-b")

    assert finish_chunk(runtime, stale, red(stale)) is None

    items = items_by_key(runtime, job_id).values()
    assert {(i.status, i.lease_owner) for i in items} == {(ItemStatus.RUNNING, "run-b")}
    assert results.shard_keys(stale.place) == []
    assert job_row(runtime, job_id).status == JobStatus.RUNNING


def test_a_shard_also_holds_the_chunk_items_finished_before(runtime: WorkerRuntime) -> None:
    """A chunk whose first item was cancelled before this run: the shard still has every item
    of the chunk, once, in id order."""
    job_id, calls = submit(runtime, FILES[:3])
    with runtime.sessions() as session:
        session.execute(
            update(Item)
            .where(Item.job_id == job_id, Item.key == "r.png")
            .values(status=ItemStatus.CANCELLED, finished_at=utcnow())
        )
        session.commit()
    lease = take(runtime, job_id, 0, calls[0].item_ids)
    assert [i.key for i in lease.items] == ["g.png", "b.png"]

    finish_chunk(runtime, lease, red(lease))

    shard = shard_rows(runtime, job_id, 0)
    assert [(r["key"], r["status"]) for r in shard] == [
        ("r.png", "cancelled"), ("g.png", "succeeded"), ("b.png", "succeeded"),
    ]  # fmt: skip


def test_the_last_chunk_of_a_cancelling_job_closes_it_cancelled(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    lease = take(runtime, job_id, 0, calls[0].item_ids)  # running when the cancel comes
    with runtime.sessions() as session:
        assert cancel_job(session, "acme", job_id).status == JobStatus.CANCELLING

    assert finish_chunk(runtime, lease, red(lease)) == JobStatus.CANCELLED

    written = manifest(runtime, lease)
    assert written is not None and written["status"] == "cancelled"
    assert written["counts"]["succeeded"] == 3 and written["counts"]["cancelled"] == 2
    assert len(written["shards"]) == 2  # chunk 1 never ran: its shard is written from the DB
    assert {r["status"] for r in shard_rows(runtime, job_id, 1)} == {"cancelled"}


def test_a_chunk_of_a_cancelled_job_writes_its_manifest(runtime: WorkerRuntime) -> None:
    """Cancelled before any chunk ran: the first message delivered leases nothing, and writes
    the shards and the manifest no one else would."""
    job_id, calls = submit(runtime)
    with runtime.sessions() as session:
        assert cancel_job(session, "acme", job_id).status == JobStatus.CANCELLED
    lease = take(runtime, job_id, 0, calls[0].item_ids)
    assert lease.items == [] and not lease.was_open

    assert finish_chunk(runtime, lease, ChunkRows([])) is None  # closed already, not by this call

    written = manifest(runtime, lease)
    assert written is not None and written["status"] == "cancelled"
    assert written["counts"]["cancelled"] == len(FILES)
    assert written["shards"] == results.shard_keys(lease.place)
    assert len(written["shards"]) == 2


def test_a_job_still_being_listed_stays_open(runtime: WorkerRuntime) -> None:
    """A bulk job gains chunks while its source is listed: its chunks finishing do not close
    it; the ingest does when the listing ends."""
    job_id, calls = submit(runtime, FILES[:2])
    with runtime.sessions() as session:
        session.add(Ingest(job_id=job_id))
        session.commit()
    lease = take(runtime, job_id, 0, calls[0].item_ids)

    assert finish_chunk(runtime, lease, red(lease)) is None

    assert job_row(runtime, job_id).status == JobStatus.RUNNING
    assert manifest(runtime, lease) is None


def _finished(runtime: WorkerRuntime) -> tuple[str, Lease]:
    job_id, calls = submit(runtime)
    first, last = (take(runtime, job_id, c.chunk, c.item_ids) for c in calls)
    finish_chunk(runtime, first, red(first))
    assert finish_chunk(runtime, last, red(last)) == JobStatus.COMPLETED
    return job_id, first


def test_a_replay_heals_a_missing_manifest(runtime: WorkerRuntime) -> None:
    job_id, lease = _finished(runtime)
    before = manifest(runtime, lease)
    runtime.store.delete(results.manifest_key(lease.place))

    replay = take(runtime, job_id, 0, lease.item_ids, owner="redelivered")
    assert replay.items == [] and not replay.was_open
    assert finish_chunk(runtime, replay, ChunkRows([])) is None

    assert manifest(runtime, lease) == before


def test_a_replay_leaves_a_written_manifest_alone(runtime: WorkerRuntime) -> None:
    job_id, lease = _finished(runtime)
    runtime.store.put(results.manifest_key(lease.place), b'{"marker": true}')

    replay = take(runtime, job_id, 0, lease.item_ids, owner="redelivered")
    assert finish_chunk(runtime, replay, ChunkRows([])) is None

    assert manifest(runtime, lease) == {"marker": True}


def test_an_open_job_has_no_manifest(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    lease = take(runtime, job_id, 0, calls[0].item_ids)
    with runtime.sessions() as session:  # as if it had closed (the ingest's call)
        close_closed_job(runtime, session, job_row(runtime, job_id))
    assert manifest(runtime, lease) is None


def test_missing_shards_are_written_from_the_database(runtime: WorkerRuntime) -> None:
    job_id, lease = _finished(runtime)
    lost = results.shard_key(lease.place, 1)
    before = shard_rows(runtime, job_id, 1)
    runtime.store.delete(lost)

    with runtime.sessions() as session:  # a replay of the closed job: was_open=False
        fields = output_fields(lease.model)
        job = ClosingJob(job_id, False, lease.model, lease.place, fields, None)
        close_job(session, runtime.store, job)

    assert results.shard_keys(lease.place) == [results.shard_key(lease.place, 0), lost]
    assert shard_rows(runtime, job_id, 1) == before


def test_the_reconciler_closes_a_job_whose_last_chunk_stopped_before_closing(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last chunk committed its results, then its worker died before the close: the
    job's items have all ended, and the reconciler closes it and writes its manifest."""
    job_id, calls = submit(runtime)
    first = take(runtime, job_id, 0, calls[0].item_ids)
    finish_chunk(runtime, first, red(first))
    last = take(runtime, job_id, 1, calls[1].item_ids)
    with monkeypatch.context() as patch:
        patch.setattr(queries, "nothing_open", _die)
        with pytest.raises(SystemExit):
            finish_chunk(runtime, last, red(last))
    assert job_row(runtime, job_id).status == JobStatus.RUNNING
    assert {i.status for i in items_by_key(runtime, job_id).values()} == {ItemStatus.SUCCEEDED}

    report = reconcile(runtime, RecordingDispatcher(), lambda: set())

    assert report["jobs_closed"] == 1
    assert job_row(runtime, job_id).status == JobStatus.COMPLETED
    written = manifest(runtime, last)
    assert written is not None and written["counts"]["succeeded"] == len(FILES)
    assert reconcile(runtime, RecordingDispatcher(), lambda: set())["jobs_closed"] == 0


def _die(*_args: object) -> bool:
    raise SystemExit("the worker died between its two commits")


def test_groups_are_written_before_the_job_shows_closed(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever sees the job closed can read its groups (and index): the close steps run before
    the status changes, not after."""
    job_id, calls = submit(runtime, [(f"same-{i}.png", FILES[0][1]) for i in range(5)])
    seen: list[bool] = []
    close = queries.finish_job_if_done

    def watching(session: Any, job: str) -> queries.Finished | None:
        place = results.Place(runtime.store, results.results_prefix(job))
        seen.append(runtime.store.exists(results.groups_key(place)))
        return close(session, job)

    monkeypatch.setattr(queries, "finish_job_if_done", watching)
    first, last = (take(runtime, job_id, c.chunk, c.item_ids) for c in calls)
    finish_chunk(runtime, first, red(first, sha256="d1"))
    assert finish_chunk(runtime, last, red(last, sha256="d1")) == JobStatus.COMPLETED
    assert seen[-1] is True
    assert manifest(runtime, last)["identical"] == {"groups": 1, "items": 5}  # type: ignore[index]
