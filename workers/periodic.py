"""What `kiln beat` sends periodically: the reconciler and the schedule tick."""

from __future__ import annotations

import logging
from typing import Any

from app import schedules
from app.db import ingest as db
from workers.ingest import StepDispatcher
from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def reconcile(runtime: WorkerRuntime, dispatcher: StepDispatcher) -> dict[str, Any]:
    """Restart ingests whose step died (a killed worker, a lost message): the new step claims
    the stale ingest and resumes after its last committed key."""
    with runtime.sessions() as session:
        stalled = db.stalled_ingests(session, runtime.settings.ingest_stale_s)
    for job_id in stalled:
        log.warning("ingest %s is silent; sending a new step to resume it", job_id)
        dispatcher.enqueue_ingest(job_id)
    return {"ingests_resumed": len(stalled)}


def run_due_schedules(runtime: WorkerRuntime, dispatcher: StepDispatcher) -> dict[str, Any]:
    with runtime.sessions() as session:
        started = schedules.run_due(session, dispatcher)
    return {"started": started}
