"""`JobWaiters` without a database: waking, timing out, and which URLs get a listener."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kiln.app.db.notify import JobWaiters, libpq_url


def test_libpq_url_only_for_postgres() -> None:
    assert (
        libpq_url("postgresql+psycopg://kiln:pw@db:5432/kiln")
        == "postgresql://kiln:pw@db:5432/kiln"
    )
    assert libpq_url("sqlite:////tmp/kiln.db") is None


def test_sqlite_waiters_do_not_listen() -> None:
    waiters = JobWaiters("sqlite:////tmp/kiln.db")
    waiters.start()
    assert waiters.listening is False
    waiters.close()


def test_a_wait_times_out() -> None:
    waiters = JobWaiters("sqlite:////tmp/kiln.db")
    started = time.monotonic()
    asyncio.run(waiters.wait("job-1", 0.1))
    assert 0.1 <= time.monotonic() - started < 2


def test_wake_from_another_thread_ends_the_wait_at_once() -> None:
    waiters = JobWaiters("sqlite:////tmp/kiln.db")

    async def scenario() -> float:
        threading.Timer(0.1, waiters.wake, args=("job-1",)).start()
        started = time.monotonic()
        await asyncio.gather(waiters.wait("job-1", 10), waiters.wait("job-1", 10))
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 5


@pytest.mark.filterwarnings("error")
def test_waking_an_unknown_job_is_harmless() -> None:
    JobWaiters("sqlite:////tmp/kiln.db").wake("nobody-waits")
