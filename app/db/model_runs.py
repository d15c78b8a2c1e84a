"""A model's recent finished jobs as the estimate reads them: their items as worked (a span per
chunk run, frames apart) and how long each job took from submission to close."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, aware
from kiln.app.jobs.throughput import Span


@dataclass(frozen=True)
class Run:
    job_id: str
    spans: list[Span]  # its items as worked, a span per chunk run (frames and others apart)
    frame_spans: list[Span]  # those of `spans` whose items are videos' frames
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
    spans, frames = _spans(session, job.id)
    if not spans or created is None or finished is None:
        return None
    return Run(job.id, spans, frames, created, finished)


def _spans(session: Session, job_id: str) -> tuple[list[Span], list[Span]]:
    """The job's ended items as worked from their lease to their write, one span per chunk run
    and kind (`queries.finished_spans`, with frames told apart: they cost another time)."""
    is_frame = Item.frame_index.is_not(None)
    query = (
        select(Item.started_at, Item.finished_at, is_frame, func.count())
        .where(
            Item.job_id == job_id,
            Item.finished_at.is_not(None),
            Item.status.in_((ItemStatus.SUCCEEDED, ItemStatus.FAILED)),
        )
        .group_by(Item.started_at, Item.finished_at, is_frame)
    )
    spans: list[Span] = []
    frames: list[Span] = []
    for started, ended, frame, count in session.execute(query):
        end = aware(ended)
        assert end is not None  # selected so
        begun = aware(started)
        start = begun if begun is not None and begun <= end else end
        span = Span(start.timestamp(), end.timestamp(), int(count))
        spans.append(span)
        if frame:
            frames.append(span)
    return spans, frames
