"""Item leases: which chunk run holds an item, until when, and what the reconciler re-sends.

A run takes its chunk's open items with an expiry and renews it while it lives. An item whose
lease ran out (its worker was killed, its database connection lost) is taken again by the next
run of its chunk. Functions here never commit: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, func, or_, select, update
from sqlalchemy.orm import Session

from kiln.app.db.models import OPEN_JOB_STATUSES, Item, ItemStatus, Job, utcnow


def _takeable(owner: str, now: datetime) -> ColumnElement[bool]:
    """Pending, or running under a lease that ran out — or under this very run's own lease
    (a Celery retry of the same message keeps its task id, the owner)."""
    return or_(
        Item.status == ItemStatus.PENDING,
        and_(
            Item.status == ItemStatus.RUNNING,
            or_(
                Item.lease_owner == owner,
                Item.lease_expires_at.is_(None),
                Item.lease_expires_at < now,
            ),
        ),
    )


def take(
    session: Session, job_id: str, item_ids: Sequence[int], owner: str, lease_s: float
) -> list[Item]:
    """Lease the chunk's takeable items to `owner` and return them; others are left alone.

    Call with the job locked (`queries.lock_job`), so a cancel or a finishing chunk queues.
    """
    now = utcnow()
    leased = session.scalars(
        update(Item)
        .where(Item.job_id == job_id, Item.id.in_(item_ids), _takeable(owner, now))
        .values(
            status=ItemStatus.RUNNING,
            attempts=Item.attempts + 1,
            started_at=now,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_s),
        )
        .returning(Item),
        execution_options={"synchronize_session": False},
    )
    return sorted(leased, key=lambda item: item.id)


def _running(session: Session, item_ids: Sequence[int], owned: ColumnElement[bool]) -> int:
    """How many of these items are running under a lease that matches `owned`."""
    query = select(func.count()).where(
        Item.id.in_(item_ids), Item.status == ItemStatus.RUNNING, owned
    )
    return int(session.scalar(query) or 0)


def held_elsewhere(session: Session, item_ids: Sequence[int], owner: str) -> bool:
    """Some of these items run under another live lease (a duplicate message arrived)."""
    return _running(session, item_ids, Item.lease_owner != owner) > 0


def _held_by(job_id: str, owner: str) -> ColumnElement[bool]:
    return and_(Item.job_id == job_id, Item.lease_owner == owner, Item.status == ItemStatus.RUNNING)


def renew(session: Session, job_id: str, owner: str, lease_s: float) -> tuple[int, str | None]:
    """Push the lease's expiry out; returns (items still held, the job's status)."""
    result = session.execute(
        update(Item)
        .where(_held_by(job_id, owner))
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
    )
    status = session.scalar(select(Job.status).where(Job.id == job_id))
    return int(result.rowcount), status  # type: ignore[attr-defined]


def holds(session: Session, item_ids: Sequence[int], owner: str) -> int:
    """How many of these items `owner` still holds (0: its lease was taken over)."""
    return _running(session, item_ids, Item.lease_owner == owner)


def release(session: Session, job_id: str, owner: str) -> int:
    """Hand the items back (a run that stops without results): pending, no owner."""
    result = session.execute(
        update(Item)
        .where(_held_by(job_id, owner))
        .values(
            status=ItemStatus.PENDING,
            lease_owner=None,
            lease_expires_at=None,
            queued_at=utcnow(),  # the task's retry message is on its way
        )
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StrandedChunk:
    """A chunk of an open job with items waiting and, as far as Postgres knows, no run."""

    job_id: str
    chunk: int
    queue: str
    item_ids: list[int]


def reset_expired(session: Session, limit: int = 10_000) -> set[tuple[str, int]]:
    """Running items of open jobs whose lease ran out go back to pending, due at once;
    returns their (job, chunk)s."""
    now = utcnow()
    expired = (
        select(Item.id)
        .join(Job, Job.id == Item.job_id)
        .where(
            Item.status == ItemStatus.RUNNING,
            or_(Item.lease_expires_at.is_(None), Item.lease_expires_at < now),
            Job.status.in_(OPEN_JOB_STATUSES),
        )
        .limit(limit)
    )
    result = session.execute(
        update(Item)
        .where(Item.id.in_(expired))
        .values(
            status=ItemStatus.PENDING,
            lease_owner=None,
            lease_expires_at=None,
            queued_at=now - timedelta(days=1),  # stranded: due for a new message now
        )
        .returning(Item.job_id, Item.chunk),
        execution_options={"synchronize_session": False},
    )
    return {(job_id, chunk) for job_id, chunk in result}


def stranded_chunks(
    session: Session, older_than_s: float, limit: int = 1000
) -> list[StrandedChunk]:
    """Chunks of open jobs with pending items last sent more than `older_than_s` ago; each
    with all its pending items, so a re-sent message covers the whole chunk."""
    stale = and_(
        Item.status == ItemStatus.PENDING,
        or_(Item.queued_at.is_(None), Item.queued_at < utcnow() - timedelta(seconds=older_than_s)),
    )
    found = session.execute(
        select(Item.job_id, Item.chunk, Job.queue)
        .join(Job, Job.id == Item.job_id)
        .where(stale, Job.status.in_(OPEN_JOB_STATUSES))
        .distinct()
        .limit(limit)
    ).all()
    chunks: list[StrandedChunk] = []
    for job_id, chunk, queue in found:
        ids = session.scalars(
            select(Item.id)
            .where(Item.job_id == job_id, Item.chunk == chunk, Item.status == ItemStatus.PENDING)
            .order_by(Item.id)
        )
        chunks.append(StrandedChunk(job_id, chunk, queue, list(ids)))
    return chunks


def mark_sent(session: Session, item_ids: Sequence[int]) -> None:
    session.execute(
        update(Item)
        .where(Item.id.in_(item_ids), Item.status == ItemStatus.PENDING)
        .values(queued_at=utcnow())
    )
