"""Fair share between tenants on the bulk queue, on the real stack (`kiln api`, `kiln worker`,
Postgres, Redis, moto S3; the session worker: 4 task threads, bulk chunks of 8 items, so the
window is 2 × 4 = 8 chunks).

Tenant A (`acme`) starts two bulk jobs of 200 objects (50 chunks); tenant B (`globex`) submits
one of 40 (5 chunks) once A's are running. In one FIFO, B's chunks would run after every chunk
of A's already sent — all of them — so B would end with A. With the fair share, B's chunks go
out as A's in-flight ones finish, and B ends while most of A is still to run. Measured by
the items' own finish times, not the wall clock, so a loaded machine does not change it.
(The full-size figures, before and after: bench/fair_share.py.)
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from sqlalchemy import func, select

from devstack.jobs import wait_closed
from kiln.app.db.models import Ingest, Item
from tests.integration.test_bulk import put_objects
from tests.stack import SOURCE_BUCKET

A_JOBS, A_ITEMS, B_ITEMS = 2, 200, 40


def submit(client: httpx.Client, prefix: str) -> str:
    body = {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def wait_running(client: httpx.Client, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued":
        assert time.monotonic() < deadline, f"job {job_id} never started"
        time.sleep(0.05)


def test_a_later_tenant_s_bulk_job_is_not_queued_behind_another_s_backlog(
    client: httpx.Client, other_client: httpx.Client, s3: Any, sessions: Any
) -> None:
    for j in range(A_JOBS):
        put_objects(s3, [f"fair-a{j}/img-{i:04d}.jpg" for i in range(A_ITEMS)], seed=10 + j)
    put_objects(s3, [f"fair-b/img-{i:04d}.jpg" for i in range(B_ITEMS)], seed=20)

    a_jobs = [submit(client, f"fair-a{j}/") for j in range(A_JOBS)]
    wait_running(client, a_jobs[0])
    with sessions() as session:  # A's backlog is recorded, and only the window of it sent
        sent = session.scalars(select(Ingest.chunks_sent).where(Ingest.job_id.in_(a_jobs)))
        assert sum(sent) < A_JOBS * A_ITEMS // 8
    b_job = submit(other_client, "fair-b/")

    b = wait_closed(other_client, b_job, timeout=300)
    a = [wait_closed(client, job_id, timeout=300) for job_id in a_jobs]
    assert b["status"] == "completed" and b["counts"]["succeeded"] == B_ITEMS
    assert all(j["status"] == "completed" and j["counts"]["succeeded"] == A_ITEMS for j in a)

    with sessions() as session:
        b_done = session.scalar(select(func.max(Item.finished_at)).where(Item.job_id == b_job))
        a_after = session.scalar(
            select(func.count()).where(Item.job_id.in_(a_jobs), Item.finished_at > b_done)
        )
    # one FIFO: ~0 of A's items finish after B's last; the fair share: most of them
    assert a_after >= 0.4 * A_JOBS * A_ITEMS, f"only {a_after} of A's items finished after B"
