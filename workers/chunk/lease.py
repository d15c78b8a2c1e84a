"""Keep a chunk run's lease alive while it works, and notice a cancel or a lost lease.

A thread renews the lease every `lease_renew_s`. A renewal that fails (the database is
restarting) is retried at the next tick: the lease is long enough to ride out a short outage,
and if it does run out, another run takes the items and this run's results are discarded.

Renewal is bounded: a run older than `max_s` (a deadlocked work thread, an engine call that
never returns) is no longer renewed — its lease runs out and the reconciler gives its items to
another run — and the worker's `health` says so until the run ends, so a liveness probe
restarts a worker whose run never does.
"""

from __future__ import annotations

import logging
import threading
import time
from types import TracebackType

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db import leases
from kiln.app.db.models import JobStatus
from kiln.app.db.session import unit_of_work
from kiln.workers.health import Health

log = logging.getLogger(__name__)


class LeaseKeeper:
    """Renews `owner`'s lease on the job's items until closed; a context manager."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        job_id: str,
        owner: str,
        lease_s: float,
        renew_s: float,
        max_s: float = float("inf"),
        health: Health | None = None,
    ) -> None:
        self.job_id, self.owner = job_id, owner
        self.lease_s, self.renew_s, self.max_s = lease_s, renew_s, max_s
        self.health = health or Health()
        self._started = time.monotonic()
        self.cancelled = threading.Event()  # the job is cancelling: stop taking new work
        self.lost = threading.Event()  # another run holds the items now
        self._sessions = sessions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{owner[:8]}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.health.clear(self._health_key)

    @property
    def _health_key(self) -> str:
        return f"run:{self.owner}"

    def overran(self) -> bool:
        """Past its longest lease: stop renewing, give the items up, report it (once)."""
        if time.monotonic() - self._started <= self.max_s:
            return False
        if not self.lost.is_set():
            sentence = (
                f"a chunk run of job {self.job_id} has held its items for more than "
                f"{self.max_s:g} s (KILN_RUN_MAX_S); its lease is left to run out"
            )
            log.error(sentence, extra={"job_id": self.job_id})
            self.health.fail(self._health_key, sentence)
            self.lost.set()  # whatever it finishes is not written: the items went elsewhere
        return True

    def renew_once(self) -> None:
        with self._sessions() as session, unit_of_work(session):
            held, status = leases.renew(session, self.job_id, self.owner, self.lease_s)
        if status == JobStatus.CANCELLING:
            self.cancelled.set()
        if held == 0 and not self._stop.is_set():
            log.warning("chunk run %s of job %s lost its lease", self.owner, self.job_id)
            self.lost.set()

    def _run(self) -> None:
        while not self._stop.wait(self.renew_s):
            if self.overran():
                continue
            try:
                self.renew_once()
            except Exception as error:  # the database is away: try again next tick
                log.warning(
                    "could not renew lease %s of job %s: %s", self.owner, self.job_id, error
                )
