"""Try a model: drop images (or type text), pick a model, see its answer and how long each
stage took. The inputs become a job through the same submission as `POST /v1/jobs` (an
interactive one: a few inputs go on the interactive queue), so nothing bypasses the queue."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse

from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep
from kiln.app.api.errors import RequestTooLargeError
from kiln.app.catalog.catalog import ModelInfo, get_model, list_models
from kiln.app.console import views
from kiln.app.console.auth import ActingTenant, CheckedForm, ConsoleTenant
from kiln.app.console.pages import render
from kiln.app.core.errors import InputError
from kiln.app.jobs import jobs

router = APIRouter(prefix="/console/try", include_in_schema=False)
MAX_FILES = 16  # a try, not a batch: bigger sets go through the API or `kiln submit`
ANSWER_ITEMS = MAX_FILES


def _models(context: ApiContext, tenant: str) -> list[ModelInfo]:
    with context.sessions() as session:
        return list_models(session, tenant)


@router.get("")
async def try_page(request: Request, context: ContextDep, tenant: ConsoleTenant) -> HTMLResponse:
    models = await run_in_threadpool(_models, context, tenant)
    return render(request, "try.html", tenant=tenant, models=models, max_files=MAX_FILES)


async def _request(
    context: ApiContext, tenant: str, model: str, files: list[UploadFile], text: str
) -> jobs.JobRequest:
    limit = context.settings.max_upload_bytes
    uploads = []
    for upload in [f for f in files if f.filename][:MAX_FILES]:
        data = await upload.read(limit + 1)
        if len(data) > limit:
            raise RequestTooLargeError(
                f"{upload.filename} is larger than the {limit:,}-byte limit."
            )
        uploads.append(jobs.Upload(upload.filename or "", data, upload.content_type))
    lines = [line for line in text.splitlines() if line.strip()][:MAX_FILES]
    if not uploads and not lines:
        raise InputError("Drop one or more images, or type some text, to try a model.")
    inputs = [jobs.InputRef(text=line, key=f"text-{i:02d}") for i, line in enumerate(lines)]
    return jobs.JobRequest(tenant=tenant, model=model, uploads=uploads, inputs=inputs)


@router.post("")
async def try_submit(
    request: Request,
    context: ContextDep,
    tenant: ActingTenant,
    _form: CheckedForm,
    model: Annotated[str, Form(min_length=1, max_length=160)],
    files: Annotated[list[UploadFile] | None, Form()] = None,
    text: Annotated[str, Form(max_length=64_000)] = "",
) -> RedirectResponse:
    job_request = await _request(context, tenant, model, files or [], text)

    def submit() -> str:
        with context.sessions() as session:
            return context.submit_job(session, job_request).job.id

    job_id = await run_in_threadpool(submit)
    return RedirectResponse(f"/console/try/{job_id}", status_code=303)


def _answer(
    context: ApiContext, tenant: str, job_id: str
) -> tuple[views.JobView, ModelInfo, views.ItemsPage]:
    with context.sessions() as session:
        job = jobs.get_job(session, tenant, job_id)
        model = get_model(session, job.model, tenant)
        return (
            views.job_view(session, job, jobs.LeaseTiming.of(context.settings)),
            model,
            views.items_page(session, job, model, None, 0, ANSWER_ITEMS),
        )


@router.get("/{job_id}")
async def try_result(
    request: Request, job_id: str, context: ContextDep, tenant: ConsoleTenant
) -> HTMLResponse:
    job, model, page = await run_in_threadpool(_answer, context, tenant, job_id)
    return render(request, "try_result.html", tenant=tenant, job=job, model=model, page=page)


@router.get("/{job_id}/answer")
async def try_answer(
    request: Request, job_id: str, context: ContextDep, tenant: ConsoleTenant
) -> HTMLResponse:
    """The answers so far; asks again every second until the job closes."""
    job, model, page = await run_in_threadpool(_answer, context, tenant, job_id)
    return render(request, "_answer.html", job=job, model=model, page=page)
