"""The fleet: live workers (device, backend per model, warm models, batch sizes and engine time
per batch), queue lengths, and per-GPU utilisation, memory, temperature and power charted as
the page polls (`data.json` every few seconds; the browser keeps the last 120 points).

Workers publish their facts to Postgres every few seconds (`workers/ops/facts.py`); the API reads
them back (`app/api/fleet.py`). A GPU figure NVML did not answer is absent, never zero."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse

from kiln.app.api import fleet
from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep
from kiln.app.console.auth import ConsoleTenant
from kiln.app.console.pages import render
from kiln.app.dispatch.contract import QUEUES
from kiln.app.dispatch.depths import read_queue_lengths

router = APIRouter(prefix="/console/fleet", include_in_schema=False)
POLL_S = 3


def _fleet(context: ApiContext, tenant: str) -> dict[str, Any]:
    with context.sessions() as session:
        workers = fleet.live_workers(session, tenant)
    queues = read_queue_lengths(context.celery, context.settings.broker_url, QUEUES)
    return {"workers": workers, "queues": queues}


@router.get("")
async def fleet_page(request: Request, context: ContextDep, tenant: ConsoleTenant) -> HTMLResponse:
    shown = await run_in_threadpool(_fleet, context, tenant)
    return render(request, "fleet.html", tenant=tenant, poll_s=POLL_S, **shown)


@router.get("/workers")
async def fleet_workers(
    request: Request, context: ContextDep, tenant: ConsoleTenant
) -> HTMLResponse:
    """The workers and queues part, for the page's live refresh."""
    shown = await run_in_threadpool(_fleet, context, tenant)
    return render(request, "_fleet_workers.html", poll_s=POLL_S, **shown)


@router.get("/data.json")
async def fleet_data(context: ContextDep, tenant: ConsoleTenant) -> dict[str, Any]:
    """Each live worker's latest GPU sample, for the charts."""
    shown = await run_in_threadpool(_fleet, context, tenant)
    return {
        "workers": [
            {"worker": w.worker, "seen_at": w.seen_at.timestamp(), "gpu": w.gpu}
            for w in shown["workers"]
        ]
    }
