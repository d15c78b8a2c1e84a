"""Looking up a tenant's pipelines, their runs and their live objects (the pipeline endpoints,
the search of a pipeline's library)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import ColumnElement, and_, func, not_, select
from sqlalchemy.orm import Session

from kiln.app.db.models import (
    OPEN_JOB_STATUSES,
    Item,
    ItemStatus,
    Job,
    Pipeline,
    PipelineObject,
)


def tenant_pipeline(session: Session, tenant: str, name: str) -> Pipeline | None:
    return session.scalar(select(Pipeline).where(Pipeline.tenant == tenant, Pipeline.name == name))


def latest_closed_run(session: Session, pipeline_id: int) -> Job | None:
    """The pipeline's newest run that has closed: its close updated the library last."""
    return session.scalar(
        select(Job)
        .where(Job.pipeline_id == pipeline_id, Job.status.not_in(OPEN_JOB_STATUSES))
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(1)
    )


def jobs_that_processed(session: Session, pipeline_id: int, keys: Sequence[str]) -> dict[str, str]:
    """For each key, the pipeline's newest run whose item of that key succeeded (the item a
    thumbnail is made from: a later run skips an unchanged object, so it has no item)."""
    if not keys:
        return {}
    rows = session.execute(
        select(Item.key, Item.job_id)
        .join(Job, Job.id == Item.job_id)
        .where(
            Job.pipeline_id == pipeline_id,
            Item.key.in_(list(keys)),
            Item.status == ItemStatus.SUCCEEDED,
        )
        .order_by(Job.created_at, Job.id)
    )
    return {key: job_id for key, job_id in rows}  # the newest run last, so it wins


def tenant_pipelines(session: Session, tenant: str) -> list[Pipeline]:
    """The tenant's pipelines, by name."""
    return list(
        session.scalars(select(Pipeline).where(Pipeline.tenant == tenant).order_by(Pipeline.name))
    )


def runs(session: Session, pipeline_id: int, limit: int | None = None) -> list[Job]:
    """The pipeline's runs, newest first (at most `limit`)."""
    query = (
        select(Job)
        .where(Job.pipeline_id == pipeline_id)
        .order_by(Job.created_at.desc(), Job.id.desc())
    )
    return list(session.scalars(query.limit(limit) if limit is not None else query))


def run_count(session: Session, pipeline_id: int) -> int:
    return int(session.scalar(select(func.count()).where(Job.pipeline_id == pipeline_id)) or 0)


def live_keys(session: Session, pipeline_id: int) -> set[str]:
    """The objects the pipeline's last listing saw: what its source holds (a run forgets the
    objects its listing no longer finds, once that listing ends)."""
    return set(session.scalars(select(PipelineObject.key).where(_of(pipeline_id))))


def _of(pipeline_id: int) -> ColumnElement[bool]:
    return PipelineObject.pipeline_id == pipeline_id


# An object whose current content has a result (of any version of the pipeline's model).
_done = and_(PipelineObject.done_etag.is_not(None), PipelineObject.done_etag == PipelineObject.etag)


@dataclass(frozen=True)
class Failure:
    """A live object whose newest result, at its current ETag, is a failure."""

    key: str
    error: str | None
    job_id: str


@dataclass(frozen=True)
class ObjectCounts:
    """A pipeline's live objects: their current content succeeded (`succeeded`), failed at
    it (`failures`: known failures), or has no result yet (the rest: new, changed, or its run
    has not reached it)."""

    objects: int
    succeeded: int
    failures: list[Failure]

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def pending(self) -> int:
        return self.objects - self.succeeded - self.failed


def object_counts(session: Session, pipeline_id: int) -> ObjectCounts:
    """Counts of the live objects. A failure is found among the objects not done at their
    current ETag only (usually few): the newest finished item of that key, failed at that
    ETag. A video's failed frames are its results, not a failed object."""
    objects, succeeded = session.execute(
        select(func.count(), func.count().filter(_done)).where(_of(pipeline_id))
    ).one()
    rows = session.execute(
        select(
            Item.key,
            Item.status,
            Item.error,
            Item.etag,
            Item.job_id,
            PipelineObject.etag.label("current"),
        )
        .join(Job, Job.id == Item.job_id)
        .join(
            PipelineObject,
            and_(PipelineObject.pipeline_id == Job.pipeline_id, PipelineObject.key == Item.key),
        )
        .where(
            Job.pipeline_id == pipeline_id,
            Item.status.in_((ItemStatus.SUCCEEDED, ItemStatus.FAILED)),
            not_(_done),
        )
        .order_by(Job.created_at, Job.id)
    )
    newest = {row.key: row for row in rows}  # the newest run last, so it wins
    failures = [
        Failure(row.key, row.error, row.job_id)
        for key, row in sorted(newest.items())
        if row.status == ItemStatus.FAILED and row.etag == row.current
    ]
    return ObjectCounts(int(objects), int(succeeded), failures)
