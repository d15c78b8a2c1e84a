"""A tenant's pipelines as they stand: their runs, their live objects (succeeded, known
failures, not yet processed), their schedule, and their current results (one row per live
object: `pipeline_results`). A pipeline is what a named incremental bulk run (`kiln bulk …
--name`) or a schedule's first run creates; reading it never writes."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.app.core.errors import NotFoundError
from kiln.app.db import pipelines, queries
from kiln.app.db.models import Job, Pipeline, Schedule
from kiln.app.jobs import retention
from kiln.app.results import pipeline_results, results
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory

SHOWN_FAILURES = 100  # known failures listed by name in a pipeline's answer; all are counted


@dataclass(frozen=True)
class RunState:
    job: Job
    counts: queries.Counts


@dataclass(frozen=True)
class PipelineState:
    pipeline: Pipeline
    run_count: int
    runs: list[RunState]  # newest first: the last run alone in a listing, more for one pipeline
    objects: pipelines.ObjectCounts
    schedule: Schedule | None

    @property
    def last_run(self) -> RunState | None:
        return self.runs[0] if self.runs else None


def get_pipeline(session: Session, tenant: str, name: str) -> Pipeline:
    """The tenant's pipeline `name`; 404 with a sentence (naming a schedule that has not run
    yet, which is not a pipeline until then)."""
    pipeline = pipelines.tenant_pipeline(session, tenant, name)
    if pipeline is not None:
        return pipeline
    schedule = _schedule(session, tenant, name)
    if schedule is not None:
        raise NotFoundError(
            f"Pipeline {name!r} has not run yet: schedule {name!r} starts its first run at "
            f"{schedule.next_run_at:%Y-%m-%d %H:%M} UTC."
        )
    raise NotFoundError(
        f"There is no pipeline {name!r}; a named bulk run (`kiln bulk … --name {name}`) or a "
        "schedule creates one."
    )


def list_pipelines(session: Session, tenant: str) -> list[PipelineState]:
    """The tenant's pipelines by name, each with its last run."""
    return [state(session, p, 1) for p in pipelines.tenant_pipelines(session, tenant)]


def state(session: Session, pipeline: Pipeline, runs: int) -> PipelineState:
    """The pipeline with its newest `runs` runs and their counts."""
    return PipelineState(
        pipeline=pipeline,
        run_count=pipelines.run_count(session, pipeline.id),
        runs=[
            RunState(job, retention.summary_counts(job) or queries.job_counts(session, job.id))
            for job in pipelines.runs(session, pipeline.id, runs)
        ],
        objects=pipelines.object_counts(session, pipeline.id),
        schedule=_schedule(session, pipeline.tenant, pipeline.name),
    )


def result_sources(
    session: Session, store: ObjectStore, s3: S3Factory, tenant: str, name: str
) -> tuple[list[pipeline_results.Run], set[str]]:
    """What the pipeline's current results are computed from (`pipeline_results.plan`): its
    runs, newest first, with where their shards are, and its live objects. Runs retention
    swept are left out: an object whose only result was in one has none now."""
    pipeline = get_pipeline(session, tenant, name)
    runs = [
        pipeline_results.Run(job.id, results.place_for(store, job.id, job.output, s3))
        for job in pipelines.runs(session, pipeline.id)
        if job.summary is None  # retention deleted its shards (`app/jobs/retention.py`)
    ]
    return runs, pipelines.live_keys(session, pipeline.id)


def _schedule(session: Session, tenant: str, name: str) -> Schedule | None:
    return session.scalar(select(Schedule).where(Schedule.tenant == tenant, Schedule.name == name))
