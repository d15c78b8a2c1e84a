"""POST /v1/jobs/estimate: what a bulk job over a source would hold and take, before it is
created (`kiln.app.jobs.estimate`). Nothing is written: no job, no pipeline, no message."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter

from kiln.app.api.deps import ContextDep, S3Dep, TenantDep
from kiln.app.api.errors import error_responses
from kiln.app.api.routes.jobs import with_fps
from kiln.app.api.schemas import EstimateOut, JobCreate
from kiln.app.core.errors import InputError
from kiln.app.jobs import estimate
from kiln.app.jobs.ingest import BulkRequest, Source

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post(
    "/estimate",
    response_model=EstimateOut,
    responses=error_responses(400, 401, 403, 422, 503),
)
def estimate_job(body: JobCreate, context: ContextDep, tenant: TenantDep, s3: S3Dep) -> EstimateOut:
    """A bulk job's body (`model`, `source`, `options`, `video_fps`) → its objects, bytes,
    images, videos and their sampled frames, items, and the time at the fleet's measured rate
    for the model with the workers alive now. A huge prefix is sampled (`sampled`, `note`).
    Checked as a submission is (model, options, the tenant's buckets); creates nothing."""
    if body.source is None:
        raise InputError('An estimate is of a bucket: give a "source" (s3 prefix and filters).')
    src = body.source
    request = BulkRequest(
        tenant=tenant,
        model=body.model,
        source=Source(src.s3, tuple(src.include), tuple(src.exclude), src.case_sensitive),
        options=with_fps(body.options, body.video_fps),
    )
    with context.sessions() as session:
        model, options = estimate.check(session, request)
        fleet = estimate.read_fleet(session, model, context.settings)
    # Listed with no session held: a large prefix takes seconds.
    found = estimate.estimate(request, options, fleet, s3(), estimate.Bounds.of(context.settings))
    return EstimateOut(**asdict(found))
