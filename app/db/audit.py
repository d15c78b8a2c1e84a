"""`kiln db recount`: each job's kept counters against its items, one job per transaction."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from tenacity import retry, retry_if_exception_type, stop_after_attempt

from kiln.app.db import counters
from kiln.app.db.models import Job
from kiln.app.db.session import unit_of_work


@dataclass
class RecountReport:
    checked: int = 0
    differing: list[tuple[str, counters.Tally]] = field(default_factory=list)


def recount_jobs(session: Session, job_ids: Sequence[str] | None, *, fix: bool) -> RecountReport:
    """Compare (and with `fix`, repair) the counters of these jobs, or of every job. Each job
    is read in one snapshot, so chunks finishing meanwhile are never taken for drift."""
    if job_ids is None:
        with unit_of_work(session):  # ended before the first job's snapshot begins
            job_ids = list(session.scalars(select(Job.id).order_by(Job.created_at)))
    report = RecountReport()
    for job_id in job_ids:
        with unit_of_work(session):
            counters.snapshot(session)
            missing = (
                counters.repair(session, job_id) if fix else counters.difference(session, job_id)
            )
        report.checked += 1
        if missing != counters.Tally():
            report.differing.append((job_id, missing))
    return report


@retry(retry=retry_if_exception_type(OperationalError), stop=stop_after_attempt(5), reraise=True)
def _recount(session: Session, job_id: str, fix: bool) -> counters.Tally:
    """One job in one snapshot. A repair that meets a chunk updating the same counter row is
    refused by Postgres (a serialization failure) and tried again on a fresh snapshot."""
    with unit_of_work(session):
        counters.snapshot(session)
        if fix:
            return counters.repair(session, job_id)
        return counters.difference(session, job_id)
