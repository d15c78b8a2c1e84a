"""POST /v1/jobs/{id}/retry: a new job over a closed job's failed items (`app/jobs/retry.py`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Header, Request, Response, status
from fastapi.concurrency import run_in_threadpool

from kiln.app.api.deps import ContextDep, TenantDep
from kiln.app.api.errors import error_responses
from kiln.app.api.routes.jobs import job_out
from kiln.app.api.routes.webhooks import checked_notify
from kiln.app.api.schemas import JobOut, RetryIn
from kiln.app.jobs import retry

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post(
    "/{job_id}/retry",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses=error_responses(400, 401, 403, 404, 409, 422, 429, 503),
)
async def retry_job(
    request: Request,
    response: Response,
    job_id: str,
    context: ContextDep,
    tenant: TenantDep,
    body: Annotated[RetryIn | None, Body()] = None,
    idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> JobOut:
    """Replay a closed job's failed items (with `include_cancelled`, its cancelled ones too)
    as a new job: same model version and options unless the body names others, its
    `retry_of` naming this job, which lists it in `retries`. 409 while the job is open or
    when it has nothing to replay; with the same `Idempotency-Key` (header or body) the
    first retry is answered again (200)."""
    asked = body or RetryIn()
    replay = retry.RetryRequest(
        tenant=tenant,
        job_id=job_id,
        include_cancelled=asked.include_cancelled,
        model=asked.model,
        options=asked.options,
        idempotency_key=asked.idempotency_key or idempotency_key,
        notify=asked.notify.model_dump() if asked.notify else None,
    )

    def start() -> JobOut:
        # A webhook the retry names passes the submission's checks (its host resolves: here,
        # in a thread); one copied from the original was checked when that was submitted.
        checked_notify(replay.notify, context.settings)
        with context.sessions() as session:
            settings = context.settings
            submitted = retry.retry_job(
                session, context.dispatcher, settings, replay, settings.tenant_max_open_jobs
            )
            if not submitted.created:
                response.status_code = status.HTTP_200_OK
            return job_out(request, session, submitted.job, submitted.counts)

    out = await run_in_threadpool(start)
    response.headers["Location"] = str(request.url_for("get_job", job_id=out.id))
    return out
