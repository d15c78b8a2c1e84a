"""A worker's life as Kubernetes sees it: ready (the probe's file) only once connected and warmed
up, and SIGTERM is a warm shutdown that finishes the chunks in hand before the process exits.

Its own Redis database and worker, so the session's shared worker cannot take the chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from devstack.services import (
    Process,
    kiln_command,
    settings_for,
    wait_for,
)
from devstack.services import service_env as full_env
from kiln.app.db.models import Item
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.workers.celery.app import make_celery
from tests.integration.test_bulk import put_objects
from tests.stack import SOURCE_BUCKET

OBJECTS = 1500


@pytest.fixture
def own_broker(own_broker_env: dict[str, str]) -> dict[str, str]:
    return {**own_broker_env, "KILN_CONTENT_CACHE": "false"}


def _count(sessions: Any, job_id: str, status: str) -> int:
    with sessions() as session:
        query = select(func.count()).where(Item.job_id == job_id, Item.status == status)
        return int(session.scalar(query) or 0)


def test_ready_after_warm_up_and_sigterm_finishes_the_chunks_in_hand(
    own_broker: dict[str, str], s3: Any, sessions: Any, log_dir: Path, tmp_path: Path
) -> None:
    prefix = "lifecycle/"
    put_objects(s3, [f"{prefix}img-{i:05d}.jpg" for i in range(OBJECTS)], seed=23)
    ready = tmp_path / "ready"
    args = ["worker", "--hostname", "lifecycle@localhost", "--concurrency", "4"]
    args += ["--ready-file", str(ready), "--warm", "phash"]
    worker = Process("worker-lifecycle", kiln_command(*args), full_env(own_broker), log_dir)
    celery = make_celery(settings_for(own_broker))
    try:
        wait_for(ready.exists, 90, "the worker's ready file")
        assert ready.read_text().split() == ["ready", "phash"]
        with sessions() as session:
            job_id = submit_bulk(
                session,
                CeleryDispatcher(celery),
                BulkRequest("acme", "phash", Source(f"s3://{SOURCE_BUCKET}/{prefix}")),
            ).job.id
        wait_for(lambda: _count(sessions, job_id, "succeeded") >= 100, 120, "the job midway")
        at_sigterm = _count(sessions, job_id, "succeeded")
        worker.proc.terminate()  # SIGTERM, as the kubelet sends it
        assert worker.proc.wait(60) == 0
        done = _count(sessions, job_id, "succeeded")
        print(f"SIGTERM at {at_sigterm} succeeded; {done} once the worker exited")
        assert done < OBJECTS, "the job finished before SIGTERM; make it larger"
        # Every chunk the worker held finished: no item is left leased to it.
        assert _count(sessions, job_id, "running") == 0
        assert not ready.exists()
        assert "warm shutdown" in worker.log_tail(200).lower()
    finally:
        worker.stop()
        celery.close()
