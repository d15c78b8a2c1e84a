"""A model's recent finished jobs as the estimate reads them: their items as worked (a span per
chunk run) and how long each job took from submission to close."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.app.db.models import Job, JobStatus, aware
from kiln.app.db.queries import finished_spans
from kiln.app.jobs.throughput import Span


@dataclass(frozen=True)
class Run:
    job_id: str
    spans: list[Span]  # its items as worked, one span per chunk run (`queries.finished_spans`)
    created_at: datetime
    finished_at: datetime

    @property
    def items(self) -> int:
        return sum(s.items for s in self.spans)

    @property
    def wall_s(self) -> float:
        """Seconds from its submission to its close: what a caller waits."""
        return (self.finished_at - self.created_at).total_seconds()


def recent_runs(session: Session, model: str, since: datetime, limit: int) -> list[Run]:
    """The model's jobs that completed since `since`, newest first, at most `limit`: bulk jobs
    when there are any (their chunks are the size an estimated bulk job's are), else any."""
    for bulk_only in (True, False):
        query = select(Job).where(
            Job.model == model, Job.status == JobStatus.COMPLETED, Job.finished_at >= since
        )
        if bulk_only:
            query = query.where(Job.source.is_not(None))
        jobs = list(session.scalars(query.order_by(Job.finished_at.desc()).limit(limit)))
        runs = [run for job in jobs if (run := _run(session, job)) is not None]
        if runs:
            return runs
    return []


def _run(session: Session, job: Job) -> Run | None:
    created, finished = aware(job.created_at), aware(job.finished_at)
    spans = finished_spans(session, job.id)
    if not spans or created is None or finished is None:
        return None
    return Run(job.id, spans, created, finished)
