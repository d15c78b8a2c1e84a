"""Queries for the bulk queue's fair share (app/jobs/fair_share.py): the open bulk jobs with
what each has sent and not finished, and the next unsent chunks of one job.

A bulk job's chunks are *recorded* by its ingest (items, `jobs.chunk_count`) and *sent* in
chunk order: those numbered below `ingests.chunks_sent` have had a message; the rest wait.
Like `queries`, these never commit: the caller owns the transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import ColumnElement, ScalarSelect, func, select
from sqlalchemy.orm import Session

from kiln.app.db.models import (
    OPEN_ITEM_STATUSES,
    Ingest,
    Item,
    Job,
    JobStatus,
    TenantSettings,
    WorkerFacts,
    utcnow,
)

# Jobs whose chunks may still run: a cancelling job's pending items are cancelled already.
SENDING_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING)


@dataclass(frozen=True)
class BulkJob:
    """An open bulk job as the fair share sees it."""

    job_id: str
    tenant: str
    weight: float  # its tenant's share_weight
    in_flight: int  # chunks sent whose items are not all finished (queued or running)
    unsent: int  # chunks recorded and not sent yet


def _in_flight(sent: ColumnElement[int]) -> ScalarSelect[int]:
    """Chunks of the job below `sent` with an open item (a correlated count, by the job's
    open items: ix_items_job_status)."""
    return (
        select(func.count(func.distinct(Item.chunk)))
        .where(Item.job_id == Job.id, Item.status.in_(OPEN_ITEM_STATUSES), Item.chunk < sent)
        .scalar_subquery()
    )


def open_bulk_jobs(session: Session) -> list[BulkJob]:
    """Every open bulk job (those an ingest feeds), oldest first: one statement."""
    weight = func.coalesce(TenantSettings.share_weight, 1.0)
    rows = session.execute(
        select(
            Job.id,
            Job.tenant,
            weight,
            _in_flight(Ingest.chunks_sent.expression),
            Job.chunk_count - Ingest.chunks_sent,
        )
        .join(Ingest, Ingest.job_id == Job.id)
        .outerjoin(TenantSettings, TenantSettings.tenant == Job.tenant)
        .where(Job.status.in_(SENDING_STATUSES))
        .order_by(Job.created_at, Job.id)
    ).all()
    return [
        BulkJob(job_id, tenant, float(w), int(flying or 0), max(0, int(unsent or 0)))
        for job_id, tenant, w, flying, unsent in rows
    ]


def live_workers(session: Session, max_age_s: float) -> int:
    """Workers that published their facts in the last `max_age_s`."""
    since = utcnow() - timedelta(seconds=max_age_s)
    return int(session.scalar(select(func.count()).where(WorkerFacts.seen_at >= since)) or 0)


@dataclass(frozen=True)
class Sendable:
    """One job's chunks to send now, locked for the unit that records them sent."""

    job_id: str
    queue: str
    chunks: dict[int, list[int]]  # chunk → its open items' ids, in order
    sent_through: int  # `ingests.chunks_sent` once they are sent


def lock_sendable(session: Session, job_id: str, cap: int) -> Sendable | None:
    """Lock the job's ingest row (so two top-ups of one job queue), then count its chunks in
    flight again (what committed while waiting counts) and read the next unsent chunks up to
    `cap` in flight. None when the job is closed or has nothing to send."""
    found = session.execute(
        select(Ingest, Job.queue, Job.chunk_count)
        .join(Job, Job.id == Ingest.job_id)
        .where(Ingest.job_id == job_id, Job.status.in_(SENDING_STATUSES))
        .with_for_update(of=Ingest)
        .execution_options(populate_existing=True)
    ).first()
    if found is None:
        return None
    ingest, queue, chunk_count = found
    if ingest.chunks_sent >= chunk_count:
        return None
    flying = session.scalar(
        select(func.count(func.distinct(Item.chunk))).where(
            Item.job_id == job_id,
            Item.status.in_(OPEN_ITEM_STATUSES),
            Item.chunk < ingest.chunks_sent,
        )
    )
    room = cap - int(flying or 0)
    if room <= 0:
        return None
    numbers = list(
        session.scalars(
            select(Item.chunk)
            .where(
                Item.job_id == job_id,
                Item.status.in_(OPEN_ITEM_STATUSES),
                Item.chunk >= ingest.chunks_sent,
            )
            .distinct()
            .order_by(Item.chunk)
            .limit(room)
        )
    )
    if not numbers:  # recorded chunks whose items all ended elsewhere (a video's frames)
        return Sendable(job_id, queue, {}, chunk_count)
    chunks: dict[int, list[int]] = {}
    rows = session.execute(
        select(Item.chunk, Item.id)
        .where(
            Item.job_id == job_id,
            Item.chunk.in_(numbers),
            Item.status.in_(OPEN_ITEM_STATUSES),
        )
        .order_by(Item.id)
    )
    for chunk, item_id in rows:
        chunks.setdefault(chunk, []).append(item_id)
    return Sendable(job_id, queue, chunks, max(numbers) + 1)


def mark_sent_through(session: Session, job_id: str, sent_through: int) -> None:
    """Record the job's chunks below `sent_through` sent (never moving back)."""
    ingest = session.get(Ingest, job_id)
    if ingest is not None and sent_through > ingest.chunks_sent:
        ingest.chunks_sent = sent_through
