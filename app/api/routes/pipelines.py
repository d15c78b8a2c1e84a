"""/v1/pipelines: a tenant's pipelines as they stand (runs, live objects, known failures,
schedule) and their current results; their search is in `routes/search.py`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import iterate_in_threadpool
from fastapi.responses import StreamingResponse

from kiln.app.api.deps import ContextDep, S3Dep, SessionDep, TenantDep
from kiln.app.api.errors import error_responses
from kiln.app.api.schemas import (
    FailureOut,
    PipelineDetailOut,
    PipelineObjectsOut,
    PipelineOut,
    PipelineRunOut,
    RunCountsOut,
    ScheduleOut,
)
from kiln.app.results import pipeline_results, pipelines

router = APIRouter(prefix="/v1/pipelines", tags=["pipelines"])

ERRORS = error_responses(401, 403, 404, 422, 429, 503)


@router.get("", response_model=list[PipelineOut], responses=ERRORS)
def list_pipelines(request: Request, session: SessionDep, tenant: TenantDep) -> list[PipelineOut]:
    """Your pipelines by name: each with its model, source, schedule, how many runs it had, its
    last run and the counts of its live objects."""
    return [_out(request, state) for state in pipelines.list_pipelines(session, tenant)]


@router.get("/{name}", response_model=PipelineDetailOut, responses=ERRORS)
def get_pipeline(
    request: Request,
    name: str,
    session: SessionDep,
    tenant: TenantDep,
    runs: Annotated[int, Query(ge=1, le=200, description="How many runs, newest first.")] = 20,
) -> PipelineDetailOut:
    """The pipeline: its runs with their counts, its last run, its schedule, its live objects
    and its known failures (objects whose newest result, of their current content, failed)."""
    pipeline = pipelines.get_pipeline(session, tenant, name)
    state = pipelines.state(session, pipeline, runs)
    failures = state.objects.failures[: pipelines.SHOWN_FAILURES]
    return PipelineDetailOut(
        **_out(request, state).model_dump(),
        runs=[_run(run) for run in state.runs],
        failures=[FailureOut(key=f.key, error=f.error, job_id=f.job_id) for f in failures],
    )


@router.get(
    "/{name}/results",
    responses={**ERRORS, 200: {"content": {"application/vnd.apache.parquet": {}}}},
    response_class=Response,
)
def get_pipeline_results(name: str, context: ContextDep, s3: S3Dep, tenant: TenantDep) -> Response:
    """The pipeline's current results as one Parquet file: one row per live object (every
    frame, for a video) — the row of the newest run that processed it, with that run's
    `job_id` — objects deleted from the source gone, a failure as its latest sentence. Made
    from the runs' shards, streamed shard by shard: the API holds one shard at a time."""
    with context.sessions() as session:
        runs, live = pipelines.result_sources(session, context.store, s3, tenant, name)
    current = pipeline_results.plan(runs, live)  # a shard it cannot read answers here, not midway
    return StreamingResponse(
        iterate_in_threadpool(pipeline_results.stream(current)),
        media_type="application/vnd.apache.parquet",
        headers={
            "Content-Disposition": f'attachment; filename="{name}.parquet"',
            "X-Kiln-Live-Objects": str(len(live)),
        },
    )


def _out(request: Request, state: pipelines.PipelineState) -> PipelineOut:
    p, o = state.pipeline, state.objects
    return PipelineOut(
        name=p.name,
        model=p.model,
        source=p.source,
        output=p.output,
        created_at=p.created_at,
        run_count=state.run_count,
        last_run=_run(state.last_run) if state.last_run else None,
        schedule=ScheduleOut.model_validate(state.schedule) if state.schedule else None,
        objects=PipelineObjectsOut(
            live=o.objects, succeeded=o.succeeded, failed=o.failed, pending=o.pending
        ),
        results_url=str(request.url_for("get_pipeline_results", name=p.name)),
    )


def _run(run: pipelines.RunState) -> PipelineRunOut:
    job, c = run.job, run.counts
    return PipelineRunOut(
        id=job.id,
        model=job.model,
        status=job.status,
        created_at=job.created_at,
        finished_at=job.finished_at,
        error=job.error,
        counts=RunCountsOut(
            total=c.total,
            succeeded=c.succeeded,
            failed=c.failed,
            cancelled=c.cancelled,
            pending=c.pending,
            skipped=c.skipped,
            deleted=c.deleted,
            known_failed=c.known_failed,
            excluded=c.excluded,
        ),
    )
