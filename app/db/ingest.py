"""Queries for bulk jobs: the ingest claim, items by page, pipeline object state.

Like `queries`, they never commit: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db import items as item_rows
from kiln.app.db.models import (
    OPEN_ITEM_STATUSES,
    OPEN_JOB_STATUSES,
    Ingest,
    Item,
    Job,
    PipelineObject,
    utcnow,
)


@dataclass(frozen=True)
class Listed:
    """An object from a listing page that passed the source's filters."""

    key: str
    etag: str


def claim(session: Session, job_id: str, owner: str, stale_s: float) -> Ingest | None:
    """Take the job's ingest for `owner`: free, already ours, or silent for `stale_s`.

    One statement, so two steps racing for one ingest cannot both win.
    """
    now = utcnow()
    stale = now - timedelta(seconds=stale_s)
    won = session.execute(
        update(Ingest)
        .where(
            Ingest.job_id == job_id,
            Ingest.done.is_(False),
            or_(Ingest.owner.is_(None), Ingest.owner == owner, Ingest.heartbeat_at < stale),
        )
        .values(owner=owner, heartbeat_at=now)
        .returning(Ingest.job_id),
        execution_options={"synchronize_session": False},
    ).scalar_one_or_none()
    return session.get(Ingest, job_id, populate_existing=True) if won else None


def still_owner(session: Session, job_id: str, owner: str) -> Ingest | None:
    """Lock the ingest row if `owner` still holds it (else another step took over)."""
    return session.scalar(
        select(Ingest)
        .where(Ingest.job_id == job_id, Ingest.owner == owner, Ingest.done.is_(False))
        .with_for_update()
        .execution_options(populate_existing=True)
    )


def listing(session: Session, job_id: str) -> bool:
    """The job's source is still being listed (more items may come)."""
    return bool(
        session.scalar(select(Ingest.job_id).where(Ingest.job_id == job_id, Ingest.done.is_(False)))
    )


def outstanding_chunks(session: Session, job_id: str) -> int:
    """Chunks of the job still queued or running (reads only open items, via the index)."""
    return int(
        session.scalar(
            select(func.count(func.distinct(Item.chunk))).where(
                Item.job_id == job_id, Item.status.in_(OPEN_ITEM_STATUSES)
            )
        )
        or 0
    )


def insert_items(
    session: Session,
    job_id: str,
    bucket: str,
    objects: Sequence[Listed],
    first_chunk: int,
    size: int,
) -> int:
    """One statement for a page's new items; returns how many chunks they fill."""
    if not objects:
        return 0
    items = [
        item_rows.NewItem(o.key, first_chunk + i // size, f"s3://{bucket}/{o.key}", etag=o.etag)
        for i, o in enumerate(objects)
    ]
    item_rows.insert_items(session, job_id, items, skip_existing=True)
    return -(-len(objects) // size)


@dataclass(frozen=True)
class Sorted:
    """A page's objects as a pipeline's run sees them: those to process (new, changed, or last
    done by another model version), and how many it keeps as they are."""

    fresh: list[Listed]
    unchanged: int = 0  # done before at this ETag by this model version
    known_failed: int = 0  # failed before at this ETag with this model version: kept


def changed_objects(
    session: Session,
    pipeline_id: int,
    job_id: str,
    model: str,
    objects: Sequence[Listed],
    retry_failed: bool = False,
) -> Sorted:
    """Mark a page's objects seen by this run, and sort them: an object done at its ETag by
    `model` is skipped; one whose input failed at its ETag with `model` is a known failure,
    kept unless `retry_failed`; the rest are processed."""
    if not objects:
        return Sorted([])
    keys = [o.key for o in objects]
    rows = session.execute(
        select(
            PipelineObject.key,
            PipelineObject.done_etag,
            PipelineObject.done_model,
            PipelineObject.failed_etag,
            PipelineObject.failed_model,
        ).where(PipelineObject.pipeline_id == pipeline_id, PipelineObject.key.in_(keys))
    ).all()
    done = {key: etag for key, etag, by, _, _ in rows if by == model}
    failed = {key: etag for key, _, _, etag, by in rows if by == model and not retry_failed}
    statement = dialect.insert(session, PipelineObject).values(
        [
            {"pipeline_id": pipeline_id, "key": o.key, "etag": o.etag, "seen_job": job_id}
            for o in objects
        ]
    )
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[PipelineObject.pipeline_id, PipelineObject.key],
            set_={"etag": statement.excluded.etag, "seen_job": statement.excluded.seen_job},
        )
    )
    unchanged = [o for o in objects if done.get(o.key) == o.etag]
    kept = [o for o in objects if done.get(o.key) != o.etag and failed.get(o.key) == o.etag]
    fresh = [o for o in objects if done.get(o.key) != o.etag and failed.get(o.key) != o.etag]
    return Sorted(fresh, len(unchanged), len(kept))


def _etag_in(job_id: str) -> Any:
    """The ETag the job's item of each pipeline object was listed at (a correlated subquery)."""
    return (
        select(Item.etag)
        .where(Item.job_id == job_id, Item.key == PipelineObject.key)
        .scalar_subquery()
    )


def mark_done(
    session: Session, pipeline_id: int, job_id: str, model: str, keys: Sequence[str]
) -> None:
    """Objects this job processed successfully: remember the ETag they were processed at (and
    forget a failure before it)."""
    if not keys:
        return
    session.execute(
        update(PipelineObject)
        .where(PipelineObject.pipeline_id == pipeline_id, PipelineObject.key.in_(keys))
        .values(done_etag=_etag_in(job_id), done_model=model, failed_etag=None, failed_model=None),
        execution_options={"synchronize_session": False},
    )


def mark_failed(
    session: Session, pipeline_id: int, job_id: str, model: str, keys: Sequence[str]
) -> None:
    """Objects whose input failed in this job (unreadable, refused by the model — never a
    failure Kiln caused): remember the ETag and model version it failed at, so the next run
    keeps the failure unless the object or the model changes, or it is asked to retry."""
    if not keys:
        return
    session.execute(
        update(PipelineObject)
        .where(PipelineObject.pipeline_id == pipeline_id, PipelineObject.key.in_(keys))
        .values(failed_etag=_etag_in(job_id), failed_model=model),
        execution_options={"synchronize_session": False},
    )


def mark_videos_done(
    session: Session, pipeline_id: int, model: str, videos: Sequence[tuple[str, str | None]]
) -> None:
    """A pipeline's videos are done at the ETag their frames were planned from (the video
    items are gone, so the ETag is given): a rerun skips them while neither the video nor the
    model version changes."""
    for key, etag in videos:
        session.execute(
            update(PipelineObject)
            .where(PipelineObject.pipeline_id == pipeline_id, PipelineObject.key == key)
            .values(done_etag=etag, done_model=model, failed_etag=None, failed_model=None),
            execution_options={"synchronize_session": False},
        )


def forget_unseen(session: Session, pipeline_id: int, job_id: str) -> list[str]:
    """Objects this run's listing did not see: deleted since the last run. Forgets them."""
    return list(
        session.scalars(
            delete(PipelineObject)
            .where(PipelineObject.pipeline_id == pipeline_id, PipelineObject.seen_job != job_id)
            .returning(PipelineObject.key),
            execution_options={"synchronize_session": False},
        )
    )


def stalled_ingests(session: Session, stale_s: float) -> list[str]:
    """Open jobs whose ingest is unfinished and silent for `stale_s` (a crashed step)."""
    stale = utcnow() - timedelta(seconds=stale_s)
    return list(
        session.scalars(
            select(Ingest.job_id)
            .join(Job, Job.id == Ingest.job_id)
            .where(
                Ingest.done.is_(False),
                Job.status.in_(OPEN_JOB_STATUSES),
                or_(
                    and_(Ingest.heartbeat_at.is_(None), Job.created_at < stale),  # never started
                    Ingest.heartbeat_at < stale,
                ),
            )
        )
    )
