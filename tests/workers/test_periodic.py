"""What `kiln beat` runs (workers/jobs/periodic.py): the reconciler resuming a silent ingest and
purging the content cache, and the schedule tick. The reconciler's chunk side (expired leases,
lost messages) is tested with the leases, in tests/workers/chunk/test_lease.py."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, update

from kiln.app.db import content_cache
from kiln.app.db import ingest as ingest_db
from kiln.app.db.models import ContentCache, Ingest, Job, Schedule, utcnow
from kiln.app.dispatch.stub import IngestStep, RecordingDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.jobs.schedules import ScheduleRequest, add_schedule
from kiln.app.tenants.tenants import allow_bucket
from kiln.workers.jobs import periodic
from kiln.workers.jobs.periodic import reconcile, run_due_schedules
from kiln.workers.runtime import WorkerRuntime


def bulk_job(runtime: WorkerRuntime) -> str:
    with runtime.sessions() as session:
        allow_bucket(session, "acme", "photos")
        request = BulkRequest("acme", "phash", Source("s3://photos/"))
        return submit_bulk(session, RecordingDispatcher(), request).job.id


def went_silent(runtime: WorkerRuntime, job_id: str, seconds_ago: float) -> None:
    """The ingest's last step beat `seconds_ago` (and was claimed then)."""
    with runtime.sessions() as session:
        session.execute(
            update(Ingest)
            .where(Ingest.job_id == job_id)
            .values(owner="step-1", heartbeat_at=utcnow() - timedelta(seconds=seconds_ago))
        )
        session.commit()


def test_a_silent_ingest_gets_a_new_step_and_a_live_one_does_not(runtime: WorkerRuntime) -> None:
    stale_s = runtime.settings.ingest_stale_s
    silent, live = bulk_job(runtime), bulk_job(runtime)
    went_silent(runtime, silent, 2 * stale_s)
    went_silent(runtime, live, 0)
    dispatcher = RecordingDispatcher()

    report = reconcile(runtime, dispatcher, lambda: set())

    assert report == {
        "ingests_resumed": 1,
        "chunks_expired": 0,
        "chunks_resent": 0,
        "jobs_closed": 0,
        "cache_purged": 0,
        "runs_forgotten": 0,
        "expiries_set": 0,
        "jobs_expired": 0,
        "expired_rows": 0,
        "expired_objects": 0,
        "chunks_topped_up": 0,
    }
    assert dispatcher.ingests == [IngestStep(silent, None, 0)]  # a new owner will claim it
    assert dispatcher.calls == []


def test_nothing_to_reconcile_sends_nothing_and_reads_no_broker(runtime: WorkerRuntime) -> None:
    dispatcher = RecordingDispatcher()
    asked: list[bool] = []

    def in_flight() -> set[tuple[str, int]]:
        asked.append(True)
        return set()

    report = reconcile(runtime, dispatcher, in_flight)

    assert report == {
        "ingests_resumed": 0,
        "chunks_expired": 0,
        "chunks_resent": 0,
        "jobs_closed": 0,
        "cache_purged": 0,
        "runs_forgotten": 0,
        "expiries_set": 0,
        "jobs_expired": 0,
        "expired_rows": 0,
        "expired_objects": 0,
        "chunks_topped_up": 0,
    }
    assert asked == [] and dispatcher.ingests == [] and dispatcher.calls == []


def test_the_schedule_tick_starts_the_due_runs(runtime: WorkerRuntime) -> None:
    with runtime.sessions() as session:
        allow_bucket(session, "acme", "photos")
        add_schedule(
            session,
            ScheduleRequest("acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash"),
        )
        session.execute(update(Schedule).values(next_run_at=datetime(2020, 1, 1, tzinfo=UTC)))
        session.commit()
    dispatcher = RecordingDispatcher()

    report = run_due_schedules(runtime, dispatcher)

    [job_id] = report["started"]
    assert dispatcher.ingests == [IngestStep(job_id, None, 0)]
    with runtime.sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.source == {
            "s3": "s3://photos/",
            "include": [],
            "exclude": [],
            "case_sensitive": False,
        }
    assert run_due_schedules(runtime, RecordingDispatcher()) == {"started": []}  # not due again


def cache_rows(runtime: WorkerRuntime, ages_s: list[float]) -> None:
    """Content-cache entries `d0`, `d1`, … written `ages_s` seconds ago."""
    now = utcnow()
    with runtime.sessions() as session:
        session.add_all(
            ContentCache(
                model_key="t:acme/classify:abc",
                sha256=f"d{i}",
                outputs={},
                created_at=now - timedelta(seconds=age),
            )
            for i, age in enumerate(ages_s)
        )
        session.commit()


def cached(runtime: WorkerRuntime) -> set[str]:
    with runtime.sessions() as session:
        return set(session.scalars(select(ContentCache.sha256)))


def test_the_reconciler_purges_the_content_cache_in_steps(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    ttl_s = 3600.0
    runtime.settings = runtime.settings.model_copy(
        update={"content_cache_ttl_s": ttl_s, "content_cache_max_entries": 2}
    )
    cache_rows(runtime, [2 * ttl_s, 2 * ttl_s, 50, 40, 30, 20])  # d0, d1 expired; d2 oldest
    monkeypatch.setattr(content_cache, "PURGE_BATCH", 2)
    monkeypatch.setattr(periodic, "PURGE_STEPS", 1)

    first = reconcile(runtime, RecordingDispatcher(), lambda: set())
    assert first["cache_purged"] == 2 and cached(runtime) == {"d2", "d3", "d4", "d5"}

    monkeypatch.setattr(periodic, "PURGE_STEPS", 100)
    second = reconcile(runtime, RecordingDispatcher(), lambda: set())
    assert second["cache_purged"] == 2 and cached(runtime) == {"d4", "d5"}
    assert reconcile(runtime, RecordingDispatcher(), lambda: set())["cache_purged"] == 0


def test_the_reconciler_sends_bulk_chunks_recorded_and_never_sent(runtime: WorkerRuntime) -> None:
    """An ingest step that crashed after recording a page, before its top-up: the chunks are
    not lost (no message, but not stranded either) — the reconciler's top-up sends them, once."""
    job_id = bulk_job(runtime)
    with runtime.sessions() as session:
        objects = [ingest_db.Listed(f"k{i}", "e") for i in range(5)]
        chunks = ingest_db.insert_items(session, job_id, "photos", objects, 0, 2)
        session.execute(update(Job).where(Job.id == job_id).values(chunk_count=chunks))
        session.commit()
    dispatcher = RecordingDispatcher()

    report = reconcile(runtime, dispatcher, lambda: set())
    assert report["chunks_topped_up"] == 3 and report["chunks_resent"] == 0
    assert [c.chunk for c in dispatcher.calls] == [0, 1, 2]
    again = reconcile(runtime, dispatcher, lambda: {(job_id, c) for c in range(3)})
    assert again["chunks_topped_up"] == 0 and len(dispatcher.calls) == 3
