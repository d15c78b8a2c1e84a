"""/v1/jobs: submit, inspect, page through items, download results, cancel."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.concurrency import iterate_in_threadpool, run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.datastructures import FormData, UploadFile

from kiln.app import video
from kiln.app.api import fleet
from kiln.app.api.deps import ContextDep, S3Dep, SessionDep, TenantDep, get_context
from kiln.app.api.errors import RequestTooLargeError, error_responses, validation_sentence
from kiln.app.api.routes.webhooks import checked_notify, notify_out
from kiln.app.api.schemas import (
    CountsOut,
    ItemOut,
    ItemsPage,
    JobCreate,
    JobOut,
    JobsPage,
    NotifyIn,
    ResultUrlsOut,
    SignedUrlOut,
)
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, TransientError
from kiln.app.db import queries
from kiln.app.db.models import OPEN_JOB_STATUSES, ItemStatus, Job, JobStatus, aware, utcnow
from kiln.app.jobs import job_lookup, jobs, retention, retry
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.results import results

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

MAX_WAIT_S = 60.0
DEFAULT_PRESIGN_S, MAX_PRESIGN_S = 900, 3600  # short-lived: a leaked URL stops working soon
RECHECK_LISTENING_S = 1.0  # Postgres pushes closes; this only guards against a lost one
RECHECK_POLLING_S = 0.05  # SQLite: nothing is pushed
OPEN = {s.value for s in OPEN_JOB_STATUSES}

ERRORS = error_responses(401, 403, 404, 409, 413, 422, 429, 503)


def job_out(
    request: Request, session: Session, job: Job, counts: queries.Counts | None = None
) -> JobOut:
    settings = get_context(request).settings
    kept = counts or retention.summary_counts(job)  # an expired job's counters are gone
    report = jobs.progress(session, job, jobs.LeaseTiming.of(settings), kept)
    c = report.counts
    return JobOut(
        id=job.id,
        model=job.model,
        status=job.status,
        counts=CountsOut(
            total=c.total,
            done=report.processed,
            succeeded=c.succeeded,
            failed=c.failed,
            pending=report.waiting,
            running=report.running,
            answered=report.answered,
            cancelled=c.cancelled,
            skipped=c.skipped,
            deleted=c.deleted,
            known_failed=c.known_failed,
            excluded=c.excluded,
            fell_back=c.fell_back,
            fell_back_succeeded=c.fell_back_succeeded,
            expanding=queries.unplanned_videos(session, job.id, c.pending),
        ),
        created_at=report.created_at,
        started_at=report.started_at,
        finished_at=report.finished_at,
        items_per_second=report.items_per_second,
        eta_seconds=report.eta_seconds,
        stalled_since=report.stalled_since,
        waiting_for_worker=_waiting_for_worker(request, session, report),
        listing=c.listing,
        source=job.source,
        pipeline=job_lookup.pipeline_name(session, job),
        schedule=job.schedule,
        output=job.output,
        options=job.options or {},
        results_url=str(request.url_for("get_results", job_id=job.id)),
        error=job.error,
        notify=notify_out(session, job),
        retry_of=job.retry_of,
        retries=retry.retries_of(session, job.id),
        expires_at=retention.expires_at(session, settings, job),
        expired_at=aware(job.expired_at),
    )


@router.post(
    "",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses={**ERRORS, **error_responses(400)},
    openapi_extra={
        "requestBody": {
            "content": {
                "application/json": {"schema": JobCreate.model_json_schema()},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["model", "files"],
                        "properties": {
                            "model": {"type": "string"},
                            "files": {
                                "type": "array",
                                "items": {"type": "string", "format": "binary"},
                            },
                            "idempotency_key": {"type": "string"},
                            "options": {"type": "string", "description": "A JSON object."},
                            "video_fps": {
                                "type": "number",
                                "description": "Frames sampled per second of video (0: all).",
                            },
                        },
                    }
                },
            },
            "required": True,
        }
    },
)
async def create_job(
    request: Request,
    response: Response,
    context: ContextDep,
    tenant: TenantDep,
    s3: S3Dep,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JobOut:
    """Submit a job: multipart uploads (`model` + `files`), JSON `inputs`, or a JSON `source`
    bucket prefix (a bulk job, listed by the workers; optionally an incremental `pipeline`)."""
    job_request = await _read_request(request, context.settings, tenant, idempotency_key)

    def submit() -> JobOut:
        notify = checked_notify(job_request.notify, context.settings)  # resolves: in a thread
        with context.sessions() as session:
            if isinstance(job_request, BulkRequest):
                most_open = context.settings.tenant_max_open_jobs
                bulk = replace(job_request, notify=notify)
                submitted = submit_bulk(
                    session, context.dispatcher, bulk, most_open, s3=s3
                )  # its output probed (outputs.check_output)
            else:
                submitted = context.submit_job(session, replace(job_request, notify=notify))
            if not submitted.created:
                response.status_code = status.HTTP_200_OK
            return job_out(request, session, submitted.job, submitted.counts)

    out = await run_in_threadpool(submit)
    response.headers["Location"] = str(request.url_for("get_job", job_id=out.id))
    return out


async def _read_request(
    request: Request, settings: Settings, tenant: str, header_key: str | None
) -> jobs.JobRequest | BulkRequest:
    content_type = request.headers.get("content-type", "")
    length = int(request.headers.get("content-length") or 0)
    if length > settings.max_upload_bytes * settings.max_files_per_job:
        raise RequestTooLargeError("The request is larger than Kiln accepts for one job.")
    if content_type.startswith("multipart/form-data"):
        return await _read_multipart(request, settings, tenant, header_key)
    if content_type.startswith("application/json"):
        try:
            body = JobCreate.model_validate_json(await request.body())
        except ValidationError as error:
            raise InputError(validation_sentence(error.errors())) from None
        if body.source is not None:
            return BulkRequest(
                tenant=tenant,
                model=body.model,
                source=Source(
                    body.source.s3,
                    tuple(body.source.include),
                    tuple(body.source.exclude),
                    body.source.case_sensitive,
                ),
                pipeline=body.pipeline,
                output=body.output,
                options=with_fps(body.options, body.video_fps),
                idempotency_key=body.idempotency_key or header_key,
                retry_failed=body.retry_failed,
                notify=body.notify.model_dump() if body.notify else None,
                retention_s=_expires_after(body, settings),
            )
        return jobs.JobRequest(
            tenant=tenant,
            model=body.model,
            inputs=[jobs.InputRef(uri=i.uri, text=i.text) for i in body.inputs or []],
            options=with_fps(body.options, body.video_fps),
            idempotency_key=body.idempotency_key or header_key,
            notify=body.notify.model_dump() if body.notify else None,
            retention_s=_expires_after(body, settings),
        )
    raise InputError("Send the job as multipart/form-data (files) or application/json (inputs).")


async def _read_multipart(
    request: Request, settings: Settings, tenant: str, header_key: str | None
) -> jobs.JobRequest:
    # The context closes the spooled upload files as soon as their bytes are read.
    async with request.form(max_files=settings.max_files_per_job, max_fields=20) as form:
        return await _job_from_form(form, settings, tenant, header_key)


async def _job_from_form(
    form: FormData, settings: Settings, tenant: str, header_key: str | None
) -> jobs.JobRequest:
    model = form.get("model")
    if not isinstance(model, str) or not model:
        raise InputError("The form needs a 'model' field naming the model to run.")
    uploads = []
    for entry in form.getlist("files"):
        if not isinstance(entry, UploadFile):
            raise InputError("'files' must be file uploads.")
        data = await entry.read(settings.max_upload_bytes + 1)
        if len(data) > settings.max_upload_bytes:
            raise RequestTooLargeError(
                f"{entry.filename} is larger than the {settings.max_upload_bytes:,}-byte limit."
            )
        uploads.append(jobs.Upload(entry.filename or "", data, entry.content_type))
    if not uploads:
        raise InputError("The form needs one or more 'files'.")
    key = form.get("idempotency_key")
    return jobs.JobRequest(
        tenant=tenant,
        model=model,
        uploads=uploads,
        options=with_fps(_options(form.get("options")), form.get(video.FPS_OPTION)),
        idempotency_key=key if isinstance(key, str) and key else header_key,
        notify=_notify_field(form.get("notify")),
        retention_s=_expires_after_field(form.get("expires_after"), settings),
    )


def _notify_field(raw: object) -> dict[str, Any] | None:
    """A form's `notify` field: the webhook as JSON ({"url": …, "events": […]})."""
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise InputError('\'notify\' must be a JSON object such as {"url": "https://…"}.')
    try:
        return NotifyIn.model_validate_json(raw).model_dump()
    except ValidationError as error:
        raise InputError("notify: " + validation_sentence(error.errors())) from None


def _expires_after_field(raw: object, settings: Settings) -> int | None:
    """A form's `expires_after` field ("7d", "3600"), checked as the JSON body's is."""
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise InputError("'expires_after' must be a duration such as 7d or 3600 (seconds).")
    return retention.check_retention(raw, settings)


def _expires_after(body: JobCreate, settings: Settings) -> int | None:
    """The job's own retention in seconds (422 with a sentence if out of bounds)."""
    if body.expires_after is None:
        return None
    return retention.check_retention(body.expires_after, settings)


def with_fps(options: dict[str, Any], fps: object) -> dict[str, Any]:
    """The job's options with its `video_fps` (a JSON field or a form field), if given."""
    if fps is None or fps == "":
        return options
    return {**options, video.FPS_OPTION: video.check_fps(fps)}


def _options(raw: object) -> dict[str, Any]:
    if raw is None or raw == "":
        return {}
    try:
        options = json.loads(str(raw))
    except json.JSONDecodeError:
        raise InputError("'options' must be a JSON object.") from None
    if not isinstance(options, dict):
        raise InputError("'options' must be a JSON object.")
    return options


@router.get("", response_model=JobsPage, responses=ERRORS)
def list_jobs(
    request: Request,
    session: SessionDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    after: Annotated[
        str | None, Query(max_length=36, description="`next` from the last page")
    ] = None,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    pipeline: Annotated[
        str | None, Query(max_length=128, description="Runs of this pipeline only.")
    ] = None,
    schedule: Annotated[
        str | None, Query(max_length=128, description="Runs this schedule started only.")
    ] = None,
) -> JobsPage:
    """Your jobs, newest first; optionally of one status, pipeline or schedule."""
    cursor = queries.tenant_job(session, tenant, after) if after else None
    if after and cursor is None:
        raise InputError(f"{after!r} is not a cursor from this listing.")
    only = queries.JobFilter(status_, pipeline, schedule)
    page = queries.list_jobs(session, tenant, after=cursor, limit=limit, only=only)
    return JobsPage(
        jobs=[job_out(request, session, job) for job in page],
        next=page[-1].id if len(page) == limit else None,
    )


def _waiting_for_worker(request: Request, session: Session, report: jobs.Progress) -> bool:
    """Items wait, none runs, and no worker reports (asked once per request)."""
    if report.finished_at is not None or not report.waiting or report.running:
        return False
    if not hasattr(request.state, "workers_live"):
        request.state.workers_live = fleet.any_live(session)
    return not request.state.workers_live


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
async def get_job(
    request: Request,
    job_id: str,
    context: ContextDep,
    tenant: TenantDep,
    wait: Annotated[
        float,
        Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for an open job to close."),
    ] = 0,
) -> JobOut:
    """The job; with `wait`, answer as soon as it closes (or when the wait is over)."""

    def read() -> JobOut:
        with context.sessions() as session:
            return job_out(request, session, jobs.get_job(session, tenant, job_id))

    deadline = time.monotonic() + wait
    while True:
        out = await run_in_threadpool(read)
        remaining = deadline - time.monotonic()
        if out.status not in OPEN or remaining <= 0:
            return out
        # Pushed closes wake us at once; re-reading now and then covers a missed one.
        recheck = RECHECK_LISTENING_S if context.waiters.listening else RECHECK_POLLING_S
        await context.waiters.wait(out.id, min(remaining, recheck))


@router.get("/{job_id}/items", response_model=ItemsPage, responses=ERRORS)
def list_items(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    status_: Annotated[ItemStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[int, Query(ge=0, description="`next` from the last page")] = 0,
) -> ItemsPage:
    """The job's items in submission order, optionally of one status."""
    job = jobs.get_job(session, tenant, job_id)
    page = queries.list_items(session, job.id, status=status_, after=after, limit=limit)
    return ItemsPage(
        items=[
            ItemOut(
                key=i.key,
                status=i.status,
                error=i.error,
                attempts=i.attempts,
                duration_ms=i.duration_ms,
                outputs=i.outputs,
                answered_by=i.answered_by,
                fallback_reason=i.fallback_reason,
                frame_index=i.frame_index,
                frame_time_s=i.frame_time_s,
            )
            for i in page
        ],
        next=str(page[-1].id) if len(page) == limit else None,
    )


@router.get(
    "/{job_id}/results",
    responses={**ERRORS, 200: {"content": {"application/vnd.apache.parquet": {}}}},
    response_class=Response,
)
def get_results(
    job_id: str, session: SessionDep, context: ContextDep, s3: S3Dep, tenant: TenantDep
) -> Response:
    """All results so far as one Parquet file (`key`, `status`, `error`, model outputs),
    streamed shard by shard: the API holds one shard at a time, whatever the job's size."""
    job = jobs.get_job(session, tenant, job_id)
    retention.check_not_expired(job)
    place = results.place_for(context.store, job.id, job.output, s3)
    return StreamingResponse(
        iterate_in_threadpool(results.stream_parquet(place)),
        media_type="application/vnd.apache.parquet",
        headers={
            "Content-Disposition": f'attachment; filename="{job.id}.parquet"',
            "X-Kiln-Job-Status": job.status,
        },
    )


@router.get(
    "/{job_id}/groups",
    responses={**ERRORS, 200: {"content": {"application/vnd.apache.parquet": {}}}},
    response_class=Response,
)
def get_groups(
    job_id: str, session: SessionDep, context: ContextDep, s3: S3Dep, tenant: TenantDep
) -> Response:
    """The closed job's duplicate groups as Parquet (`group`, `key`, `similarity`, `sha256`):
    byte-identical inputs for every model, near-duplicates for phash and embedders asked to
    group; empty when it found none. 409 while the job runs, 503 in the moment between its
    close and its manifest: groups are made when it closes, before the manifest."""
    job = jobs.get_job(session, tenant, job_id)
    if queries.is_open(job):
        raise ConflictError(
            f"Job {job.id} is still {job.status}; its groups are made when it closes."
        )
    retention.check_not_expired(job)
    place = results.place_for(context.store, job.id, job.output, s3)
    if not place.store.exists(results.manifest_key(place)):  # its close steps write it last
        raise TransientError(
            f"Job {job.id} has just closed and its groups are still being written; "
            "ask again in a moment."
        )
    return Response(
        results.groups_parquet(place),
        media_type="application/vnd.apache.parquet",
        headers={"Content-Disposition": f'attachment; filename="{job.id}-groups.parquet"'},
    )


@router.get("/{job_id}/results/urls", response_model=ResultUrlsOut, responses=ERRORS)
def get_result_urls(
    job_id: str,
    session: SessionDep,
    context: ContextDep,
    s3: S3Dep,
    tenant: TenantDep,
    expires: Annotated[
        int, Query(ge=1, le=MAX_PRESIGN_S, description="Seconds the URLs stay valid.")
    ] = DEFAULT_PRESIGN_S,
) -> ResultUrlsOut:
    """The manifest and shards as presigned GET URLs (S3 storage only), to hand to a tool
    that reads Parquet directly; they expire after `expires` seconds."""
    job = jobs.get_job(session, tenant, job_id)
    retention.check_not_expired(job)
    place = results.place_for(context.store, job.id, job.output, s3)
    try:
        manifest, shards = results.presign_results(place, expires)
    except ConflictError:
        raise ConflictError(
            f"Presigned URLs need S3 storage; download through /v1/jobs/{job.id}/results."
        ) from None
    return ResultUrlsOut(
        job_id=job.id,
        status=job.status,
        expires_at=utcnow() + timedelta(seconds=expires),
        manifest=SignedUrlOut(key=manifest.key, url=manifest.url) if manifest else None,
        shards=[SignedUrlOut(key=s.key, url=s.url) for s in shards],
    )


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS)
def cancel_job(request: Request, job_id: str, session: SessionDep, tenant: TenantDep) -> JobOut:
    """Cancel: pending items never run; finished results are kept."""
    return job_out(request, session, jobs.cancel_job(session, tenant, job_id))
