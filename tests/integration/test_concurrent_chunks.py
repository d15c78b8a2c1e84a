"""Chunks of one job finishing at the same moment on Postgres: the last one closes the job."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from devstack.images import photo
from kiln.app.core.config import Settings
from kiln.app.db import counters, queries
from kiln.app.dispatch.stub import Enqueued, RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.workers.chunk.run import process_chunk
from kiln.workers.runtime import WorkerRuntime


def two_chunks(runtime: WorkerRuntime, settings: Settings, seed: int) -> tuple[str, list[Enqueued]]:
    """A job of two chunks of photos, submitted on Postgres; its id and chunk messages."""
    dispatcher = RecordingDispatcher()
    files = [Upload(f"p{i}.jpg", photo(seed + i)) for i in range(2 * settings.chunk_size)]
    with runtime.sessions() as session:
        request = JobRequest(tenant="acme", model="detector", uploads=files)
        job_id = submit_job(session, runtime.store, dispatcher, settings, request).job.id
    return job_id, dispatcher.calls


def test_two_chunks_finishing_together_close_the_job(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = WorkerRuntime(migrated)
    job_id, calls = two_chunks(runtime, migrated, seed=500)
    first, second = calls
    # Both chunks commit their results, then meet here before looking for open items (in a
    # transaction of their own): each sees the other's results, and exactly one closes the job.
    meet = threading.Barrier(2, timeout=2)
    real_check = queries.nothing_open

    def check_together(*args: Any) -> bool:
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait()
        return real_check(*args)

    monkeypatch.setattr(queries, "nothing_open", check_together)
    reports: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda c=c: reports.append(process_chunk(runtime, job_id, c.chunk, c.item_ids))
        )
        for c in (first, second)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(str(r.job_status) for r in reports) == ["None", "completed"]
        with runtime.sessions() as session:
            assert queries.tenant_job(session, "acme", job_id).status == "completed"  # type: ignore[union-attr]
    finally:
        runtime.close()


def test_chunks_of_one_job_finish_without_waiting_on_each_other(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each chunk adds its results to its own counter row: two chunks can hold their finishing
    transactions open at the same moment (they meet inside them), and the counts stay exact."""
    runtime = WorkerRuntime(migrated)
    job_id, calls = two_chunks(runtime, migrated, seed=700)
    meet = threading.Barrier(2, timeout=10)
    real_add = counters.add

    def add_then_meet(session: Any, job: str, slot: int, delta: counters.Tally) -> None:
        real_add(session, job, slot, delta)
        if delta.total == 0:  # a chunk's results, not a submission: wait for the other chunk
            meet.wait()  # raises BrokenBarrierError if the other waits on a lock we hold

    monkeypatch.setattr(counters, "add", add_then_meet)
    reports: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda c=c: reports.append(process_chunk(runtime, job_id, c.chunk, c.item_ids))
        )
        for c in calls
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not meet.broken
        assert sorted(str(r.job_status) for r in reports) == ["None", "completed"]
        with runtime.sessions() as session:
            assert counters.read(session, job_id) == counters.recount(session, job_id)
            assert queries.job_counts(session, job_id).done == 2 * migrated.chunk_size
    finally:
        runtime.close()
