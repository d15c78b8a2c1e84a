"""Job closes pushed through Postgres LISTEN/NOTIFY, and long-polling clients on real services."""

from __future__ import annotations

import asyncio
import time

import httpx
import psycopg
from sqlalchemy import text

from devstack.images import photo
from kiln.app.db import queries
from kiln.app.db.notify import CHANNEL, JobWaiters, libpq_url, notify_job_closed
from tests.app.db.test_queries import make_job
from tests.integration.test_http_jobs import upload


def test_a_committed_notify_wakes_the_waiter(postgres_url: str, sessions) -> None:
    waiters = JobWaiters(postgres_url)
    waiters.start()
    try:

        async def scenario() -> float:
            await asyncio.sleep(0.5)  # the listener connects and LISTENs
            started = time.monotonic()
            waiting = asyncio.ensure_future(waiters.wait("job-42", 10))
            await asyncio.sleep(0.05)
            with sessions() as session:
                notify_job_closed(session, "job-42")
                session.commit()
            await waiting
            return time.monotonic() - started

        assert asyncio.run(scenario()) < 2  # woken by the notification, not the 10 s timeout
    finally:
        waiters.close()


def test_a_rolled_back_notify_is_never_sent(postgres_url: str, sessions) -> None:
    dsn = libpq_url(postgres_url)
    assert dsn is not None
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with sessions() as session:
            notify_job_closed(session, "job-rolled-back")
            session.rollback()
        with sessions() as session:
            session.execute(text("SELECT 1"))
            notify_job_closed(session, "job-committed")
            session.commit()
        payloads = [n.payload for n in listener.notifies(timeout=1.0)]
    assert payloads == ["job-committed"]


def test_the_close_tells_the_api_from_its_own_update(postgres_url: str, sessions) -> None:
    """`finish_job_if_done` sends the notification in its UPDATE: once, by the call that
    closes the job, and only when that commits; `closing` reads the job and its counts."""
    dsn = libpq_url(postgres_url)
    assert dsn is not None
    with sessions() as session:
        rolled, closed = (make_job(session, ["succeeded", "failed"]) for _ in range(2))
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with sessions() as session:
            assert queries.finish_job_if_done(session, rolled.id) is not None
            session.rollback()
        with sessions() as session:
            found = queries.closing(session, closed.id, [])
            assert found is not None and found.job.status == "running"
            assert (found.counts.total, found.counts.succeeded, found.counts.failed) == (2, 1, 1)
            finished = queries.finish_job_if_done(session, closed.id)
            assert finished is not None and finished.status == "completed"
            assert queries.finish_job_if_done(session, closed.id) is None  # closed: no second
            session.commit()
        payloads = [n.payload for n in listener.notifies(timeout=1.0)]
    assert payloads == [closed.id]


def test_long_poll_answers_when_the_worker_closes_the_job(client: httpx.Client) -> None:
    job = upload(client, {"one.jpg": photo(7)}).json()
    started = time.monotonic()
    done = client.get(f"/v1/jobs/{job['id']}", params={"wait": 30}).json()
    assert done["status"] == "completed"
    assert done["counts"]["succeeded"] == 1
    assert time.monotonic() - started < 10
