"""Chunks of one job finishing at the same moment on Postgres: the last one closes the job."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest

from devstack.images import photo
from kiln.app.core.config import Settings
from kiln.app.db import queries
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs import JobRequest, Upload, submit_job
from kiln.workers.chunk.run import process_chunk
from kiln.workers.runtime import WorkerRuntime


def test_two_chunks_finishing_together_close_the_job(
    migrated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = WorkerRuntime(migrated)
    dispatcher = RecordingDispatcher()
    files = [Upload(f"p{i}.jpg", photo(500 + i)) for i in range(2 * migrated.chunk_size)]
    with runtime.sessions() as session:
        job = submit_job(
            session,
            runtime.store,
            dispatcher,
            migrated,
            JobRequest(tenant="acme", model="detector", uploads=files),
        )
    first, second = dispatcher.calls
    # Both chunks write their results, then meet here before looking for open items: without
    # serialising on the job row, each sees the other's items still running and neither closes.
    meet = threading.Barrier(2, timeout=2)
    real_check = queries.has_open_items

    def check_together(*args: Any) -> bool:
        # Serialised, the other chunk waits on the job row, not here: the barrier breaks.
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait()
        return real_check(*args)

    monkeypatch.setattr(queries, "has_open_items", check_together)
    reports: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda c=c: reports.append(
                process_chunk(runtime, job.job.id, c.chunk, c.item_ids)
            )
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
            assert queries.tenant_job(session, "acme", job.job.id).status == "completed"  # type: ignore[union-attr]
    finally:
        runtime.close()
