"""The model registry (versions, and the engines workers run each on) and the schedules (last
and next run, and each run's job)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from sqlalchemy import select

from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep
from kiln.app.catalog.catalog import ModelInfo, list_models, model_versions
from kiln.app.console.auth import ConsoleTenant
from kiln.app.console.pages import render
from kiln.app.db import pipelines, queries
from kiln.app.db.models import EngineReport, Job, Schedule
from kiln.app.jobs import schedules

router = APIRouter(prefix="/console", include_in_schema=False)
RUNS_SHOWN = 5


@dataclass(frozen=True)
class ModelRow:
    info: ModelInfo
    versions: list[int]
    engines: list[EngineReport]


def _models(context: ApiContext, tenant: str) -> list[ModelRow]:
    with context.sessions() as session:
        models = list_models(session, tenant)
        engines = queries.engine_reports(session, [m.ref for m in models])
        return [
            ModelRow(
                m,
                [] if m.builtin else model_versions(session, tenant, m.name),
                [e for e in engines if e.model == m.ref],
            )
            for m in models
        ]


@router.get("/models")
async def models_page(request: Request, context: ContextDep, tenant: ConsoleTenant) -> HTMLResponse:
    models = await run_in_threadpool(_models, context, tenant)
    return render(request, "models.html", tenant=tenant, models=models)


@dataclass(frozen=True)
class ScheduleRow:
    schedule: Schedule
    runs: list[Job]  # newest first


def _runs(session: Any, tenant: str, schedule: Schedule) -> list[Job]:
    pipeline = pipelines.tenant_pipeline(session, tenant, schedule.name)  # a run's pipeline
    if pipeline is None:
        return []
    query = select(Job).where(Job.tenant == tenant, Job.pipeline_id == pipeline.id)
    return list(session.scalars(query.order_by(Job.created_at.desc()).limit(RUNS_SHOWN)))


def _schedules(context: ApiContext, tenant: str) -> list[ScheduleRow]:
    with context.sessions() as session:
        return [
            ScheduleRow(s, _runs(session, tenant, s))
            for s in schedules.list_schedules(session, tenant)
        ]


@router.get("/schedules")
async def schedules_page(
    request: Request, context: ContextDep, tenant: ConsoleTenant
) -> HTMLResponse:
    rows = await run_in_threadpool(_schedules, context, tenant)
    return render(request, "schedules.html", tenant=tenant, schedules=rows)
