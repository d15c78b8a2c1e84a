"""Kill -9 the worker running a bulk job's ingest midway: a new worker resumes the listing
after its last committed key (sent by `kiln beat`'s reconciler), and every object ends up as
exactly one item with one result.

Its own Redis database and worker processes, so the session's shared worker cannot help.
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
    start_worker,
    wait_for,
)
from devstack.services import service_env as full_env
from kiln.app.db.models import Ingest, Item, Job
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.workers.celery.app import make_celery
from tests.integration.test_bulk import put_objects
from tests.stack import SOURCE_BUCKET

# 30 list pages of 20 keys, killed after the 8th, as before at 1,500 keys in pages of 50; the
# backlog a job may hold is scaled alike (24 × 8 = 192 of 600 items, as 64 × 8 of 1,500), so
# listing is paced by the items' processing as it was.
OBJECTS = 600
PAGE = 20
KILL_AT = 8 * PAGE


@pytest.fixture
def resume_env(own_broker_env: dict[str, str]) -> dict[str, str]:
    return {
        **own_broker_env,
        "KILN_INGEST_PAGE_SIZE": str(PAGE),
        "KILN_BULK_MAX_CHUNKS": "24",
        "KILN_INGEST_PAGES_PER_STEP": "1",
        "KILN_INGEST_STALE_S": "3",
        "KILN_RECONCILE_INTERVAL_S": "1",
        "KILN_VISIBILITY_TIMEOUT_S": "6",  # chunks held by the killed worker come back
        # … and so do their items: the killed worker's leases run out in seconds, not the
        # shipped minute (renewed every 2 s while a chunk runs, as test_stalled's are)
        "KILN_LEASE_S": "8",
        "KILN_LEASE_RENEW_S": "2",
    }


def test_ingest_resumes_after_its_worker_is_killed(
    resume_env: dict[str, str], s3: Any, sessions: Any, log_dir: Path
) -> None:
    prefix = "bulk-resume/"
    put_objects(s3, [f"{prefix}img-{i:05d}.jpg" for i in range(OBJECTS)], seed=5)
    settings = settings_for(resume_env)
    celery = make_celery(settings)
    env = full_env(resume_env)
    started: list[Process] = []
    try:
        first, _ = start_worker(env, log_dir, name="worker-a", node_prefix="resume-a")
        started.append(first)
        started.append(Process("beat", kiln_command("beat"), env, log_dir))
        with sessions() as session:
            job = submit_bulk(
                session,
                CeleryDispatcher(celery),
                BulkRequest("acme", "phash", Source(f"s3://{SOURCE_BUCKET}/{prefix}")),
            ).job
            job_id = job.id
        wait_for(lambda: _listed(sessions, job_id) >= KILL_AT, 120, "ingest midway")
        first.kill()
        listed_at_kill = _listed(sessions, job_id)
        assert listed_at_kill < OBJECTS, "the ingest finished before the kill; make it larger"
        second, _ = start_worker(env, log_dir, name="worker-b", node_prefix="resume-b")
        started.append(second)
        wait_for(lambda: _status(sessions, job_id) in ("completed", "failed"), 300, "the job")
        with sessions() as session:
            job = session.get(Job, job_id)
            ingest = session.get(Ingest, job_id)
            rows = session.scalar(select(func.count()).where(Item.job_id == job_id))
            keys = session.scalar(
                select(func.count(func.distinct(Item.key))).where(Item.job_id == job_id)
            )
            succeeded = session.scalar(
                select(func.count()).where(Item.job_id == job_id, Item.status == "succeeded")
            )
        assert job is not None and ingest is not None
        assert job.status == "completed", job.error
        assert ingest.done and ingest.listed == OBJECTS  # no page listed twice or skipped
        assert rows == keys == succeeded == OBJECTS
        print(f"killed at {listed_at_kill} listed of {OBJECTS}; resumed and completed")
    finally:
        for proc in reversed(started):
            proc.stop()
        celery.close()


def _listed(sessions: Any, job_id: str) -> int:
    with sessions() as session:
        ingest = session.get(Ingest, job_id)
        return ingest.listed if ingest else 0


def _status(sessions: Any, job_id: str) -> str:
    with sessions() as session:
        job = session.get(Job, job_id)
        return job.status if job else ""
