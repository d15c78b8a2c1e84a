"""Retention's statements: which closed jobs get an expiry, which have expired, and their rows
deleted a short batch at a time. Never commits: the caller owns each (short) transaction.

What a job owns in the database goes: its items (a video's frames are items), its counters,
its listing's row, its chunk runs' progress rows. Never `pipeline_objects`: a pipeline's
incremental skipping is per object, not per job, and outlives every run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.orm import Session

from kiln.app.db.models import (
    OPEN_JOB_STATUSES,
    ChunkRun,
    Ingest,
    Item,
    Job,
    JobCounter,
    TenantSettings,
    aware,
    utcnow,
)

ITEMS_PER_BATCH = 1_000  # one short transaction each: a chunk's write never waits behind it
STAMP_BATCH = 500  # closed jobs given their expiry per tick


@dataclass(frozen=True)
class Unstamped:
    job_id: str
    finished_at: datetime
    retention_s: int


def unstamped(session: Session, default_s: int | None, limit: int = STAMP_BATCH) -> list[Unstamped]:
    """Closed jobs with no expiry yet whose retention is known (the job's own, its tenant's or
    `default_s`): the ones to stamp. A job kept for ever (none of the three) is never one."""
    retention = func.coalesce(Job.retention_s, TenantSettings.retention_s, default_s)
    rows = session.execute(
        select(Job.id, Job.finished_at, retention)
        .outerjoin(TenantSettings, TenantSettings.tenant == Job.tenant)
        .where(
            Job.expires_at.is_(None),
            Job.expired_at.is_(None),
            Job.finished_at.is_not(None),
            Job.status.not_in(OPEN_JOB_STATUSES),
            retention.is_not(None),
        )
        .limit(limit)
    )
    return [Unstamped(str(a), aware(b) or utcnow(), int(c)) for a, b, c in rows]


def stamp(session: Session, jobs: list[Unstamped]) -> None:
    """Each job's expiry: its end plus its retention."""
    for job in jobs:
        session.execute(
            update(Job)
            .where(Job.id == job.job_id, Job.expires_at.is_(None))
            .values(expires_at=job.finished_at + timedelta(seconds=job.retention_s))
            .execution_options(synchronize_session=False)
        )


def expired(session: Session, now: datetime, limit: int) -> list[Job]:
    """Closed jobs past their expiry, not yet swept, the longest expired first (by
    `ix_jobs_expires_at`)."""
    return list(
        session.scalars(
            select(Job)
            .where(
                Job.expires_at <= now,
                Job.expired_at.is_(None),
                Job.status.not_in(OPEN_JOB_STATUSES),
            )
            .order_by(Job.expires_at)
            .limit(limit)
        )
    )


def delete_items(session: Session, job_id: str, limit: int = ITEMS_PER_BATCH) -> int:
    """Up to `limit` of the job's items; how many went. On Postgres rows another transaction
    holds are skipped, never waited for (a closed job's items are held by nobody; a late
    replay of one of its chunks finds them gone and stops)."""
    batch = (
        select(Item.id)
        .where(Item.job_id == job_id)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    result = session.execute(
        delete(Item).where(Item.id.in_(batch)).execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def has_items(session: Session, job_id: str) -> bool:
    return bool(session.scalar(select(exists().where(Item.job_id == job_id))))


def delete_job_state(session: Session, job_id: str) -> None:
    """The rest of what the job owns in the database (a few rows): counters, its listing's
    row, its chunk runs' progress rows."""
    for table in (JobCounter, Ingest):
        session.execute(delete(table).where(table.job_id == job_id))
    session.execute(delete(ChunkRun).where(ChunkRun.job_id == job_id))


def mark_expired(session: Session, job_id: str, now: datetime) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(expired_at=now)
        .execution_options(synchronize_session=False)
    )
