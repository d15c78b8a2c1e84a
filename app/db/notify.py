"""Telling the API that a job closed, so a client waiting on it gets its answer at once.

On Postgres the closing transaction sends `NOTIFY kiln_jobs, '<job id>'` (delivered only if it
commits; a job's close sends it from its own UPDATE, `closed_notice`) and the API listens on
one dedicated connection. Elsewhere (SQLite) nothing is sent and waiters fall back to
re-reading the job at a short interval.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict

from sqlalchemy import ColumnElement, func, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import InstrumentedAttribute, Session

from kiln.app.db.dialect import on_postgres

log = logging.getLogger(__name__)

CHANNEL = "kiln_jobs"


def notify_job_closed(session: Session, job_id: str) -> None:
    """Queue the notification in the current transaction (Postgres only)."""
    if on_postgres(session):
        session.execute(
            text("SELECT pg_notify(:channel, :job)"), {"channel": CHANNEL, "job": job_id}
        )


def closed_notice(job_id: InstrumentedAttribute[str]) -> ColumnElement[str]:
    """The notification as a column of the statement that closes the job (Postgres only):
    `UPDATE jobs … RETURNING …, pg_notify(…)` closes and tells in one round trip."""
    return func.pg_notify(CHANNEL, job_id)


def libpq_url(database_url: str) -> str | None:
    """The plain libpq URL of a `postgresql+psycopg://` SQLAlchemy URL; None for other databases."""
    url = make_url(database_url)
    if url.get_backend_name() != "postgresql":
        return None
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


class JobWaiters:
    """Async waiters per job id, woken by a listener thread (or by their own timeout)."""

    def __init__(self, database_url: str, *, retry_seconds: float = 2.0) -> None:
        self._dsn = libpq_url(database_url)
        self._waiters: defaultdict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = (
            defaultdict(set)
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._retry = retry_seconds
        self._thread: threading.Thread | None = None

    @property
    def listening(self) -> bool:
        """True when closes are pushed; callers may then wait longer between re-reads."""
        return self._dsn is not None

    def start(self) -> None:
        if self._dsn is not None and self._thread is None:
            self._thread = threading.Thread(
                target=self._listen, name="kiln-job-events", daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    async def wait(self, job_id: str, timeout: float) -> None:
        """Return when `job_id` is announced closed, or after `timeout` seconds."""
        entry = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._waiters[job_id].add(entry)
        try:
            await asyncio.wait_for(entry[1].wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters[job_id].discard(entry)
                if not self._waiters[job_id]:
                    del self._waiters[job_id]

    def wake(self, job_id: str) -> None:
        with self._lock:
            entries = list(self._waiters.get(job_id, ()))
        for loop, event in entries:
            loop.call_soon_threadsafe(event.set)

    def _listen(self) -> None:
        import psycopg  # a listener's own connection: on Postgres only (SQLite never imports it)

        assert self._dsn is not None
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self.wake(note.payload)
            except psycopg.Error as error:
                # Waiters still re-read the job on their own timer; nothing is lost meanwhile.
                log.warning("job events: %s; reconnecting in %.0f s", error, self._retry)
                self._stop.wait(self._retry)
