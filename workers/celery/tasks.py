"""Thin Celery adapters over plain functions: the logic lives in `workers.chunk`,
`workers.jobs.ingest` and `workers.jobs.periodic`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery import Celery
from sqlalchemy.exc import OperationalError

from kiln.app.core.errors import TransientError
from kiln.app.dispatch.contract import (
    CHUNK_TASK,
    INGEST_TASK,
    INTERACTIVE,
    QUEUES,
    RECONCILE_TASK,
    SCHEDULES_TASK,
    WEBHOOKS_TASK,
)
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.observability.tracing import consumer_span

if TYPE_CHECKING:
    from kiln.workers.runtime import WorkerRuntime
    from kiln.workers.webhooks.courier import Courier

log = logging.getLogger(__name__)

RETRY: dict[str, Any] = {
    "bind": True,
    "shared": False,  # shared tasks join every later app: a second app would run this one's
    "autoretry_for": (TransientError, OperationalError),  # a DB restart is transient too
    "retry_backoff": 2,
    "retry_backoff_max": 120,
    "retry_jitter": True,
    "max_retries": 8,
}


def register(
    app: Celery, runtime: Callable[[], WorkerRuntime], courier: Callable[[], Courier]
) -> None:
    """Add Kiln's tasks to `app`; `runtime` builds the worker's engines on first use,
    `courier` its webhook sender (woken once a task here may have ended a job)."""

    @app.task(name=CHUNK_TASK, **RETRY)  # type: ignore[untyped-decorator]
    def process_chunk(task: Any, job_id: str, chunk: int, item_ids: list[int]) -> dict[str, Any]:
        from kiln.workers.chunk.run import process_chunk as run

        queue = (task.request.delivery_info or {}).get("routing_key")
        with consumer_span(
            "kiln.process_chunk", task.request, job_id=job_id, chunk=chunk, items=len(item_ids)
        ):
            report = run(
                runtime(), job_id, chunk, item_ids, urgent=queue == INTERACTIVE,
                dispatcher=CeleryDispatcher(app),
            )  # fmt: skip
            seconds = {k: round(v, 3) for k, v in report.seconds.items()}
            log.info(
                "chunk %s/%d: %d ok, %d failed, %s",
                job_id, chunk, report.succeeded, report.failed, seconds,
                extra={"job_id": job_id, "chunk": chunk, "items": len(item_ids), "queue": queue,
                       "succeeded": report.succeeded, "failed": report.failed, "seconds": seconds},
            )  # fmt: skip
        if report.job_status is not None:  # its webhook's event, if any, is due now
            courier().wake()
        return {"processed": report.processed, "job_status": report.job_status}

    @app.task(name=INGEST_TASK, **RETRY)  # type: ignore[untyped-decorator]
    def ingest(task: Any, job_id: str, owner: str | None = None) -> dict[str, Any]:
        from kiln.workers.jobs.ingest import ingest_step

        with consumer_span("kiln.ingest", task.request, job_id=job_id):
            report = ingest_step(runtime(), CeleryDispatcher(app), job_id, owner)
            log.info(
                "ingest %s: %s, %d pages, %d objects, %d chunks",
                job_id, report.outcome, report.pages, report.listed, report.queued,
                extra={"job_id": job_id, "items": report.listed, "chunks": report.queued},
            )  # fmt: skip
        if report.outcome in ("done", "failed"):  # a listing's end may end the job
            courier().wake()
        return {"outcome": report.outcome, "listed": report.listed}

    @app.task(name=RECONCILE_TASK, **RETRY)  # type: ignore[untyped-decorator]
    def reconcile(task: Any) -> dict[str, Any]:
        from kiln.workers.celery.inflight import chunks_in_flight
        from kiln.workers.jobs.periodic import reconcile as run

        grace = runtime().settings.redispatch_after_s
        courier().wake()  # the reconciler's closes, and anything due
        return run(
            runtime(),
            CeleryDispatcher(app),
            lambda: chunks_in_flight(app, QUEUES, CHUNK_TASK, grace),
        )

    @app.task(name=SCHEDULES_TASK, **RETRY)  # type: ignore[untyped-decorator]
    def run_schedules(task: Any) -> dict[str, Any]:
        from kiln.workers.jobs.periodic import run_due_schedules

        return run_due_schedules(runtime(), CeleryDispatcher(app))

    @app.task(name=WEBHOOKS_TASK, **RETRY)  # type: ignore[untyped-decorator]
    def deliver_webhooks(task: Any) -> dict[str, Any]:
        """Beat's sweep: wake this worker's courier, which claims and sends on its own
        threads; the task returns at once and holds no task thread while receivers answer."""
        courier().wake()
        return {"woken": True}
