"""The jobs list, newest first, paged; its rows refresh themselves while any job is open."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse

from kiln.app.api.deps import ContextDep
from kiln.app.console import views
from kiln.app.console.auth import ConsoleTenant
from kiln.app.console.pages import render
from kiln.app.jobs.jobs import LeaseTiming

router = APIRouter(prefix="/console", include_in_schema=False)
PAGE = 25
Cursor = Annotated[str | None, Query(max_length=36)]


def _page(context: ContextDep, tenant: str, after: str | None) -> views.JobsPage:
    with context.sessions() as session:
        return views.jobs_page(session, tenant, after, PAGE, LeaseTiming.of(context.settings))


@router.get("/")
async def jobs_page(
    request: Request, context: ContextDep, tenant: ConsoleTenant, after: Cursor = None
) -> HTMLResponse:
    page = await run_in_threadpool(_page, context, tenant, after)
    return render(request, "jobs.html", tenant=tenant, page=page, after=after)


@router.get("/jobs/rows")
async def job_rows(
    request: Request, context: ContextDep, tenant: ConsoleTenant, after: Cursor = None
) -> HTMLResponse:
    """The table body alone, for the page's live refresh."""
    page = await run_in_threadpool(_page, context, tenant, after)
    return render(request, "_job_rows.html", page=page, after=after)
