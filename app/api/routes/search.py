"""/v1/jobs/{id}/search and /v1/jobs/{id}/thumbnail: look-alikes in a closed embedding job;
/v1/pipelines/{name}/search: look-alikes in everything a pipeline's runs have processed."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.datastructures import UploadFile

from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep, S3Dep, SessionDep, TenantDep
from kiln.app.api.errors import RequestTooLargeError, error_responses, validation_sentence
from kiln.app.api.routes.jobs import RECHECK_LISTENING_S, RECHECK_POLLING_S
from kiln.app.api.schemas import HitOut, SearchIn, SearchOut
from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError, TransientError
from kiln.app.db import pipelines
from kiln.app.results import search, thumbnails
from kiln.app.results.search import SearchQuery, Target
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory

router = APIRouter(prefix="/v1/jobs", tags=["search"])
pipeline_router = APIRouter(prefix="/v1/pipelines", tags=["search"])

ERRORS = error_responses(401, 403, 404, 409, 413, 422, 429, 503)
FORM_SCHEMA = {
    "type": "object",
    "required": ["file"],
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "The query image."},
        "k": {"type": "integer", "description": "How many items to answer, 1 to 100."},
    },
}


SEARCH_BODY = {
    "requestBody": {
        "content": {
            "application/json": {"schema": SearchIn.model_json_schema()},
            "multipart/form-data": {"schema": FORM_SCHEMA},
        },
        "required": True,
    }
}


@router.post(
    "/{job_id}/search",
    response_model=SearchOut,
    responses={**ERRORS, **error_responses(400)},  # a multipart body that does not parse
    openapi_extra=SEARCH_BODY,
)
async def search_job(
    request: Request, job_id: str, context: ContextDep, s3: S3Dep, tenant: TenantDep
) -> SearchOut:
    """The `k` items of a closed embedding job most alike to an image (multipart `file`), a
    text (JSON `text`) or one of its items (JSON `key`: its look-alikes, not itself), by
    cosine similarity. An image or text is embedded by the job's own model version through
    the queue (a one-item job, `query_job_id`): 503 if no worker answers in time."""
    query, k = await _read_query(request, context.settings)
    target, index = await run_in_threadpool(
        _open, context, s3, tenant, search.find_target, job_id, query
    )
    return await _answer(request, context, tenant, target, index, query, k)


@pipeline_router.post(
    "/{name}/search",
    response_model=SearchOut,
    responses={**ERRORS, **error_responses(400)},
    openapi_extra=SEARCH_BODY,
)
async def search_pipeline(
    request: Request, name: str, context: ContextDep, s3: S3Dep, tenant: TenantDep
) -> SearchOut:
    """The `k` objects of a pipeline's library — everything its runs have processed, kept up
    to date run by run — most alike to an image, a text or one of them (`key`), as in a job's
    search. The library searched is that of the model version of the pipeline's newest closed
    run (`job_id`, `model`); 409 until a run has built it."""
    query, k = await _read_query(request, context.settings)
    target, index = await run_in_threadpool(
        _open, context, s3, tenant, search.find_pipeline_target, name, query
    )
    return await _answer(request, context, tenant, target, index, query, k)


async def _answer(
    request: Request,
    context: ApiContext,
    tenant: str,
    target: Target,
    index: VectorIndex | None,
    query: SearchQuery,
    k: int,
) -> SearchOut:
    vector, query_job_id = await _vector(context, tenant, target, index, query)
    hits: list[search.Hit] = []
    if vector is not None:
        hits = await run_in_threadpool(search.nearest, index, vector, k, query.key)
    shown: dict[str, str] = {}  # key → the job whose item of that key a thumbnail shows
    if target.model.input == "image":
        shown = await run_in_threadpool(_thumbnail_jobs, context, target, [h.key for h in hits])
    return SearchOut(
        job_id=target.job.id,
        model=target.job.model,
        pipeline=target.pipeline.name if target.pipeline is not None else None,
        query=query.kind,
        query_job_id=query_job_id,
        hits=[
            HitOut(
                key=hit.key,
                similarity=hit.similarity,
                thumbnail_url=_thumbnail_url(request, shown[hit.key], hit.key)
                if hit.key in shown
                else None,
            )
            for hit in hits
        ],
    )


@router.get(
    "/{job_id}/thumbnail",
    responses={**ERRORS, 200: {"content": {"image/jpeg": {}}}},
    response_class=Response,
)
def get_thumbnail(
    job_id: str,
    key: Annotated[str, Query(min_length=1, max_length=1024, description="The item's key.")],
    session: SessionDep,
    context: ContextDep,
    s3: S3Dep,
    tenant: TenantDep,
    side: Annotated[
        int,
        Query(
            alias="max",
            ge=16,
            le=thumbnails.MAX_PX,
            description=f"The longer side in pixels, at most {thumbnails.MAX_PX}.",
        ),
    ] = thumbnails.THUMBNAIL_PX,
) -> Response:
    """A JPEG preview of one of the job's input images, at most `max` (default 256) pixels a
    side: never the original."""
    data = thumbnails.item_thumbnail(
        session, context.store, s3, context.settings, tenant, job_id, key, side
    )
    headers = {"Cache-Control": "private, max-age=3600"}  # a job's inputs never change
    return Response(data, media_type="image/jpeg", headers=headers)


async def _read_query(request: Request, settings: Settings) -> tuple[SearchQuery, int]:
    content_type = request.headers.get("content-type", "")
    if int(request.headers.get("content-length") or 0) > settings.max_upload_bytes + 65_536:
        raise RequestTooLargeError("The search is larger than Kiln accepts for one image.")
    if content_type.startswith("multipart/form-data"):
        return await _read_form(request, settings)
    if content_type.startswith("application/json"):
        try:
            body = SearchIn.model_validate_json(await request.body())
        except ValidationError as error:
            raise InputError(validation_sentence(error.errors())) from None
        return SearchQuery(text=body.text, key=body.key), search.check_k(body.k)
    raise InputError(
        "Send a search as multipart/form-data (an image 'file') or application/json "
        "('text' or 'key')."
    )


async def _read_form(request: Request, settings: Settings) -> tuple[SearchQuery, int]:
    async with request.form(max_files=1, max_fields=5) as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InputError("The form needs a 'file': the image to search with.")
        data = await upload.read(settings.max_upload_bytes + 1)
        raw_k = form.get("k")
    if len(data) > settings.max_upload_bytes:
        raise RequestTooLargeError(
            f"The image is larger than the {settings.max_upload_bytes:,}-byte limit."
        )
    if not data:
        raise InputError("The image file is empty.")
    return SearchQuery(image=data), search.check_k(_whole_number(raw_k))


def _whole_number(raw: object) -> int:
    if raw is None or raw == "":
        return search.DEFAULT_K
    try:
        return int(str(raw))
    except ValueError:
        raise InputError(f"k must be a whole number, not {str(raw)[:20]!r}.") from None


async def _vector(
    context: ApiContext,
    tenant: str,
    target: Target,
    index: VectorIndex | None,
    query: SearchQuery,
) -> tuple[np.ndarray | None, str | None]:
    """The query's vector and the job that embedded it (none for a key); no vector at all
    for a job with none to compare it with."""
    if query.key is not None:
        return search.key_vector(index, target, query.key), None
    if index is None:
        return None, None
    query_job_id = await run_in_threadpool(_submit, context, target, query)
    return await _embedded(context, tenant, query_job_id), query_job_id


# What a search searches, found by name: `search.find_target` (a job by its id) or
# `search.find_pipeline_target` (a pipeline by its name).
Finder = Callable[[Session, ObjectStore, S3Factory, str, str, SearchQuery], Target]


def _open(
    context: ApiContext, s3: S3Factory, tenant: str, find: Finder, name: str, query: SearchQuery
) -> tuple[Target, VectorIndex | None]:
    """The target `find` names, and its vector index."""
    with context.sessions() as session:
        target = find(session, context.store, s3, tenant, name, query)
    return target, search.job_index(context.indexes, target)


def _thumbnail_jobs(context: ApiContext, target: Target, keys: list[str]) -> dict[str, str]:
    """The job whose item shows each key: the searched job; for a pipeline, the newest run
    that processed the object (a later run skipped it: unchanged)."""
    if target.pipeline is None:
        return dict.fromkeys(keys, target.job.id)
    with context.sessions() as session:
        return pipelines.jobs_that_processed(session, target.pipeline.id, keys)


def _submit(context: ApiContext, target: Target, query: SearchQuery) -> str:
    with context.sessions() as session:
        return search.submit_query(
            session, context.store, context.dispatcher, context.settings, target, query
        )


async def _embedded(context: ApiContext, tenant: str, query_job_id: str) -> np.ndarray:
    """The query job's vector, waiting (woken by its close) at most `search_wait_s`."""
    wait = context.settings.search_wait_s
    deadline = time.monotonic() + wait
    while True:
        vector = await run_in_threadpool(_query_vector, context, query_job_id)
        if vector is not None:
            return vector
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            await run_in_threadpool(_give_up, context, tenant, query_job_id)
            raise TransientError(
                f"No worker embedded the search query within {wait:g} s (job {query_job_id}); "
                "the workers may be busy or stopped. Search again later."
            )
        recheck = RECHECK_LISTENING_S if context.waiters.listening else RECHECK_POLLING_S
        await context.waiters.wait(query_job_id, min(remaining, recheck))


def _query_vector(context: ApiContext, query_job_id: str) -> np.ndarray | None:
    with context.sessions() as session:
        return search.query_vector(session, context.store, query_job_id)


def _give_up(context: ApiContext, tenant: str, query_job_id: str) -> None:
    with context.sessions() as session:
        search.give_up(session, tenant, query_job_id)


def _thumbnail_url(request: Request, job_id: str, key: str) -> str:
    url = request.url_for("get_thumbnail", job_id=job_id)
    return str(url.include_query_params(key=key))
