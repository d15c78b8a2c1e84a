"""A job that cannot go on ends at once: `fail_job`, for a fault retrying cannot fix (its output
refuses every write). Never commits: the caller owns the transaction.
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.db import counters, queries, webhooks
from kiln.app.db.items import end_items
from kiln.app.db.models import OPEN_ITEM_STATUSES, Ingest, Item, ItemStatus, JobStatus, utcnow
from kiln.app.db.notify import notify_job_closed


def fail_job(session: Session, job_id: str, reason: str) -> bool:
    """Fail an open job with `reason`: every open item (pending, or running under any run's
    lease) fails with it, counted; its listing ends; the job is `failed`, `reason` its error.
    Whoever waits on it is woken, and a pipeline it ran for is free for a new run. A run that
    still holds some of its items finds them gone at its next renewal and stops, writing
    nothing. False when the job was no longer open (closed or failed already)."""
    job = queries.lock_job(session, job_id)  # the job row first, as every writer takes it
    if job is None:
        return False
    # A job failed already (its listing refused) may still have items a run held: they end
    # with this reason too, rather than stay open in a closed job.
    ended = end_open(session, job_id, reason)
    counters.add(session, job_id, 0, counters.Tally(failed=ended))
    if not queries.is_open(job):
        return False
    session.execute(
        update(Ingest).where(Ingest.job_id == job_id, Ingest.done.is_(False)).values(done=True)
    )
    now = utcnow()
    job.status, job.error, job.finished_at = JobStatus.FAILED, reason, now
    job.started_at = job.started_at or now
    notify_job_closed(session, job_id)
    webhooks.record_end(session, job_id, JobStatus.FAILED.value)
    return True


def end_open(session: Session, job_id: str, reason: str) -> int:
    """Fail the job's open items with `reason` (locked in id order, as a lease takes them, so
    the two queue instead of deadlocking); how many. Not counted: the caller adds them."""
    open_items = (
        select(Item.id)
        .where(Item.job_id == job_id, Item.status.in_(OPEN_ITEM_STATUSES))
        .order_by(Item.id)
        .with_for_update()
    )
    return end_items(session, open_items, ItemStatus.FAILED, reason, utcnow())
