"""One job: counts and progress (live while it runs), throughput over time, its items as a grid
of thumbnails with the model's answers drawn on (a video's frames as a strip per video, in time
order), its near-duplicate groups side by side, the Parquet download, cancel, and a retry of
its failed items."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Annotated, Any

import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, Depends, Form, Query, Request, Response
from fastapi.concurrency import iterate_in_threadpool, run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, StreamingResponse
from sqlalchemy.orm import Session

from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep, S3Dep
from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.console import views
from kiln.app.console.auth import ActingTenant, CheckedForm, ConsoleTenant
from kiln.app.console.pages import ConsoleDep, ConsoleState, render
from kiln.app.core.errors import ConflictError
from kiln.app.db import chunk_runs, queries
from kiln.app.db.models import ItemStatus, Job, aware, utcnow
from kiln.app.jobs import jobs, retry, throughput
from kiln.app.results import results, thumbnails
from kiln.app.storage.base import S3Factory

router = APIRouter(prefix="/console/jobs", include_in_schema=False)

ITEMS_PAGE = 48
GROUPS_PAGE = 12  # groups per page; each shows all its members side by side
GROUP_MEMBERS_SHOWN = 12
THROUGHPUT_BUCKETS = 60


@dataclass(frozen=True)
class Viewer:
    """What each part of a job's page is read with: the API's context, the console's caches
    (thumbnails, groups), a maker of S3 clients and the signed-in tenant."""

    context: ApiContext
    console: ConsoleState
    s3: S3Factory
    tenant: str

    def job(self, session: Session, job_id: str) -> tuple[Job, ModelInfo]:
        """The tenant's job and its model (another tenant's job: 404, as the API)."""
        job = jobs.get_job(session, self.tenant, job_id)
        return job, get_model(session, job.model, self.tenant)


def _viewer(context: ContextDep, console: ConsoleDep, s3: S3Dep, tenant: ConsoleTenant) -> Viewer:
    return Viewer(context, console, s3, tenant)


ViewerDep = Annotated[Viewer, Depends(_viewer)]


def _summary(viewer: Viewer, job_id: str) -> tuple[views.JobView, ModelInfo]:
    with viewer.context.sessions() as session:
        job, model = viewer.job(session, job_id)
        view = views.job_view(session, job, jobs.LeaseTiming.of(viewer.context.settings))
        view = replace(view, retries=tuple(retry.retries_of(session, job.id)))
        return replace(view, webhook=views.webhook_view(session, job)), model


@router.get("/{job_id}")
async def job_page(request: Request, job_id: str, viewer: ViewerDep) -> HTMLResponse:
    job, model = await run_in_threadpool(_summary, viewer, job_id)
    return render(request, "job.html", tenant=viewer.tenant, job=job, model=model)


@router.get("/{job_id}/summary")
async def job_summary(request: Request, job_id: str, viewer: ViewerDep) -> HTMLResponse:
    """Counts, progress and rate: the part of the job page that refreshes while it runs (and
    stops asking once the job has closed)."""
    job, model = await run_in_threadpool(_summary, viewer, job_id)
    return render(request, "_job_summary.html", job=job, model=model)


@router.get("/{job_id}/webhook")
async def job_webhook(request: Request, job_id: str, viewer: ViewerDep) -> HTMLResponse:
    """The job's webhook deliveries: refreshed after the job closed, while one is pending."""
    job, _model = await run_in_threadpool(_summary, viewer, job_id)
    if job.webhook is None:
        return HTMLResponse("")
    return render(request, "_webhook.html", job=job)


def _items(viewer: Viewer, job_id: str, status: str | None, after: int) -> dict[str, Any]:
    """A page of the job's items; on the first, its videos' strips above them."""
    videos = None
    console = viewer.console
    with viewer.context.sessions() as session:
        job, model = viewer.job(session, job_id)
        page = views.items_page(session, job, model, status, after, ITEMS_PAGE)
        if after == 0 and model.input == "image" and console.videos.get(job.id, True):
            videos = views.video_strips(session, job, model, status)
            if job.status not in views.OPEN and not status:  # closed: it has its frames for good
                console.videos[job.id] = bool(videos.strips)
    shown = page.items + [f for strip in (videos.strips if videos else []) for f in strip.frames]
    _add_groups(viewer, job, model, shown)
    return {"job": job, "model": model, "page": page, "videos": videos}


def _add_groups(viewer: Viewer, job: Job, model: ModelInfo, shown: list[views.ItemView]) -> None:
    if shown and job.status not in views.OPEN and model.input == "image":
        members = _group_of(_groups(viewer, job))
        for item in shown:
            item.group = members.get(item.key)


@router.get("/{job_id}/items")
async def job_items(
    request: Request,
    job_id: str,
    viewer: ViewerDep,
    status: Annotated[ItemStatus | None, Query()] = None,
    after: Annotated[int, Query(ge=0)] = 0,
) -> HTMLResponse:
    """A page of the job's items as a grid (the job page loads it into itself), under its
    videos' strips on the first page."""
    shown = await run_in_threadpool(_items, viewer, job_id, status, after)
    return render(request, "_items.html", status=status, after=after, **shown)


def _videos(
    viewer: Viewer, job_id: str, status: str | None, after: int
) -> tuple[Job, ModelInfo, views.VideosPage]:
    with viewer.context.sessions() as session:
        job, model = viewer.job(session, job_id)
        videos = views.video_strips(session, job, model, status, after)
    _add_groups(viewer, job, model, [f for s in videos.strips for f in s.frames])
    return job, model, videos


@router.get("/{job_id}/videos")
async def job_videos(
    request: Request,
    job_id: str,
    viewer: ViewerDep,
    after: Annotated[int, Query(ge=0)],
    status: Annotated[ItemStatus | None, Query()] = None,
) -> HTMLResponse:
    """The next videos' strips, after the one whose first frame is item `after`."""
    job, model, videos = await run_in_threadpool(_videos, viewer, job_id, status, after)
    return render(request, "_videos.html", job=job, model=model, videos=videos, status=status)


def _frames(
    viewer: Viewer,
    job_id: str,
    status: str | None,
    source: str,
    name: str,
    after: tuple[float, int],
) -> tuple[Job, ModelInfo, views.Strip]:
    with viewer.context.sessions() as session:
        job, model = viewer.job(session, job_id)
        strip = views.more_frames(session, job, model, status, source, name, after)
    _add_groups(viewer, job, model, strip.frames)
    return job, model, strip


@router.get("/{job_id}/frames")
async def job_frames(
    request: Request,
    job_id: str,
    viewer: ViewerDep,
    source: Annotated[str, Query(min_length=1, max_length=2048)],
    video: Annotated[str, Query(max_length=1024)],
    t: Annotated[float, Query(ge=0, allow_inf_nan=False)],
    after: Annotated[int, Query(ge=0)],
    status: Annotated[ItemStatus | None, Query()] = None,
) -> HTMLResponse:
    """More of a video's strip: its frames after the one at `t` (item `after`)."""
    job, model, strip = await run_in_threadpool(
        _frames, viewer, job_id, status, source, video, (t, after)
    )
    return render(request, "_frames.html", job=job, model=model, strip=strip, status=status)


def _groups(viewer: Viewer, job: Job) -> pa.Table:
    """The closed job's groups table, kept once read (it never changes after its close)."""
    table = viewer.console.groups.get(job.id)
    if table is None:
        place = results.place_for(viewer.context.store, job.id, job.output, viewer.s3)
        if not place.store.exists(results.manifest_key(place)):
            return pa.schema(results.GROUP_FIELDS).empty_table()  # its close is still writing
        table = results.read_groups(place) or pa.schema(results.GROUP_FIELDS).empty_table()
        viewer.console.groups[job.id] = table
    return table


def _group_of(table: pa.Table) -> dict[str, int]:
    return dict(zip(table["key"].to_pylist(), table["group"].to_pylist(), strict=True))


def _group_page(table: pa.Table, page: int) -> tuple[list[dict[str, Any]], int]:
    """Groups `page`×GROUPS_PAGE onward, each as its members (key, similarity, identical)."""
    ids = sorted(set(table["group"].to_pylist()))
    shown = ids[page * GROUPS_PAGE : (page + 1) * GROUPS_PAGE]
    rows = table.filter(pc.is_in(table["group"], pa.array(shown, pa.int32())))
    groups: dict[int, list[dict[str, Any]]] = {g: [] for g in shown}
    for row in rows.to_pylist():
        groups[row["group"]].append(row)
    listed = [
        {"id": g, "size": len(members), "members": members[:GROUP_MEMBERS_SHOWN]}
        for g, members in groups.items()
    ]
    return listed, len(ids)


def _group_view(viewer: Viewer, job_id: str, page: int) -> dict[str, Any]:
    with viewer.context.sessions() as session:
        job, model = viewer.job(session, job_id)
        view = views.job_view(session, job, jobs.LeaseTiming.of(viewer.context.settings))
    groups, total = ([], 0) if view.open else _group_page(_groups(viewer, job), page)
    return {"job": view, "model": model, "groups": groups, "total": total, "page": page}


@router.get("/{job_id}/groups")
async def job_groups(
    request: Request,
    job_id: str,
    viewer: ViewerDep,
    page: Annotated[int, Query(ge=0, le=100_000)] = 0,
) -> HTMLResponse:
    """Near-duplicate (and byte-identical) groups, each side by side."""
    shown = await run_in_threadpool(_group_view, viewer, job_id, page)
    return render(request, "groups.html", tenant=viewer.tenant, per_page=GROUPS_PAGE, **shown)


@router.get("/{job_id}/thumbnail")
def job_thumbnail(
    job_id: str,
    key: Annotated[str, Query(min_length=1, max_length=1024)],
    viewer: ViewerDep,
    side: Annotated[int, Query(alias="max", ge=16, le=thumbnails.MAX_PX)] = 192,
    boxes: bool = False,
) -> Response:
    """The item's thumbnail, with the detector's boxes drawn on when asked; made once."""
    context, tenant = viewer.context, viewer.tenant
    cache_key = (tenant, job_id, key, side, boxes)  # a hit skips the tenant check: keyed by it
    data = viewer.console.thumbnails.get(cache_key)
    if data is None:
        with context.sessions() as session:
            data = thumbnails.item_thumbnail(
                session,
                context.store,
                viewer.s3,
                context.settings,
                tenant,
                job_id,
                key,
                side,
                boxes,
            )
        viewer.console.thumbnails[cache_key] = data
    headers = {"Cache-Control": "private, max-age=3600"}
    return Response(data, media_type="image/jpeg", headers=headers)


@router.get("/{job_id}/results.parquet")
def job_results(job_id: str, context: ContextDep, s3: S3Dep, tenant: ConsoleTenant) -> Response:
    """The job's results so far as one Parquet file, as `GET /v1/jobs/{id}/results`."""
    with context.sessions() as session:
        job = jobs.get_job(session, tenant, job_id)
    place = results.place_for(context.store, job.id, job.output, s3)
    return StreamingResponse(
        iterate_in_threadpool(results.stream_parquet(place)),
        media_type="application/vnd.apache.parquet",
        headers={"Content-Disposition": f'attachment; filename="{job.id}.parquet"'},
    )


@router.post("/{job_id}/cancel")
def job_cancel(
    job_id: str, context: ContextDep, tenant: ActingTenant, _form: CheckedForm
) -> RedirectResponse:
    # ConflictError: it closed while the user confirmed; the page shows how it ended
    with context.sessions() as session, suppress(ConflictError):
        jobs.cancel_job(session, tenant, job_id)
    return RedirectResponse(f"/console/jobs/{job_id}", status_code=303)


@router.post("/{job_id}/retry")
def job_retry(
    job_id: str,
    context: ContextDep,
    tenant: ActingTenant,
    _form: CheckedForm,
    seen: Annotated[int, Form(ge=0)] = 0,
) -> RedirectResponse:
    """The "Retry failed items" button: a new job over this one's failed items, as `POST
    /v1/jobs/{id}/retry`; the browser goes to it (or, if nothing is left to retry, back).
    `seen`, the retries the page showed, makes the idempotency key: a second press of the same
    page (a double click, a resent form) answers the first press's job, not a second copy."""
    settings = context.settings
    key = f"console:retry:{job_id}:{seen}"
    asked = retry.RetryRequest(tenant=tenant, job_id=job_id, idempotency_key=key)
    with context.sessions() as session:
        try:
            new = retry.retry_job(
                session, context.dispatcher, settings, asked, settings.tenant_max_open_jobs
            ).job
        except ConflictError:  # reopened, swept, or retried meanwhile: the page says how it is
            return RedirectResponse(f"/console/jobs/{job_id}", status_code=303)
    return RedirectResponse(f"/console/jobs/{new.id}", status_code=303)


def _throughput(context: ApiContext, tenant: str, job_id: str) -> dict[str, Any]:
    """Items worked per second over the job's life, in up to `THROUGHPUT_BUCKETS` steps: each
    chunk run's items spread over the run (`throughput`), so a steady job is a steady line and
    not its chunks' writes; asked once per page view (not polled); the page adds live points
    (the job's rate) as it watches."""
    settings = context.settings
    with context.sessions() as session:
        job = jobs.get_job(session, tenant, job_id)
        start, end = aware(job.started_at), aware(job.finished_at)
        if start is None:
            return {"t": [], "rate": []}
        spans = queries.finished_spans(session, job.id)
        if end is None:  # rows answered in runs still going, as the job's rate counts them
            fresh = utcnow() - timedelta(seconds=jobs.LeaseTiming.of(settings).stale_s)
            spans += chunk_runs.in_flight(session, job.id, fresh).spans
    if not spans:
        return {"t": [], "rate": []}
    last = (end or utcnow()).timestamp()
    t, rate = throughput.series(spans, start.timestamp(), last, THROUGHPUT_BUCKETS)
    return {"t": t, "rate": rate}


@router.get("/{job_id}/throughput.json")
async def job_throughput(job_id: str, context: ContextDep, tenant: ConsoleTenant) -> dict[str, Any]:
    return await run_in_threadpool(_throughput, context, tenant, job_id)
