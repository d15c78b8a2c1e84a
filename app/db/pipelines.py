"""Looking up a tenant's pipelines and their runs (the search of a pipeline's library)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.app.db.models import OPEN_JOB_STATUSES, Item, ItemStatus, Job, Pipeline


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
