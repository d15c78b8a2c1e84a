"""Keep a chunk run's lease alive while it works, and notice a cancel or a lost lease.

A thread renews the lease every `lease_renew_s`. A renewal that fails (the database is
restarting) is retried at the next tick: the lease is long enough to ride out a short outage,
and if it does run out, another run takes the items and this run's results are discarded.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db import leases
from kiln.app.db.models import JobStatus
from kiln.app.db.session import unit_of_work

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
    ) -> None:
        self.job_id, self.owner = job_id, owner
        self.lease_s, self.renew_s = lease_s, renew_s
        self.cancelled = threading.Event()  # the job is cancelling: stop taking new work
        self.lost = threading.Event()  # another run holds the items now
        self._sessions = sessions
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{owner[:8]}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
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
            try:
                self.renew_once()
            except Exception as error:  # the database is away: try again next tick
                log.warning(
                    "could not renew lease %s of job %s: %s", self.owner, self.job_id, error
                )
