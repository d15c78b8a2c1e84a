"""The Celery side of the contract that producers need: the app's configuration and a
`Dispatcher` that sends by task name. The API builds only this; workers build on it."""

from __future__ import annotations

from typing import Any

from celery import Celery
from kombu.entity import Queue

from kiln.app.core.config import Settings
from kiln.app.dispatch.contract import CHUNK_TASK, INGEST, INGEST_TASK, INTERACTIVE, QUEUES
from kiln.app.observability.tracing import producer_span


def configure(app: Celery, settings: Settings) -> None:
    """What producers and workers must agree on: serializer, queues, transport."""
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_backend=None,
        task_ignore_result=True,
        task_acks_late=True,  # a chunk is acknowledged only once its results are written
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_default_queue=INTERACTIVE,
        task_queues=[Queue(name, routing_key=name) for name in QUEUES],  # type: ignore[no-untyped-call]
        task_create_missing_queues=False,
        broker_transport_options=transport_options(settings),
        worker_send_task_events=True,
        task_send_sent_event=False,
    )
    if settings.embedded_broker:  # kombu's own loses a message a reader catches half-written
        app.conf.broker_transport = "kiln.app.dispatch.fs_transport:Transport"


def make_producer(settings: Settings) -> Celery:
    """A Celery app that sends Kiln's messages and holds no task code (the API's)."""
    app = Celery("kiln", broker=settings.broker_url, set_as_current=False)
    configure(app, settings)
    return app


def transport_options(settings: Settings) -> dict[str, Any]:
    if settings.embedded_broker:
        folder = settings.broker_dir
        for sub in ("queue", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        return {
            "data_folder_in": str(folder / "queue"),
            "data_folder_out": str(folder / "queue"),
            "control_folder": str(folder / "control"),
            "store_processed": False,
            # kombu's default 1 s poll costs ~4x throughput on short jobs.
            "polling_interval": settings.filesystem_polling_ms / 1000.0,
        }
    return {
        # A chunk unacknowledged this long is redelivered; longer than any sane chunk.
        "visibility_timeout": settings.visibility_timeout_s,
        # Consume queues strictly in the order the worker lists them (kombu's default rotates
        # round-robin, which lets a bulk backlog delay an interactive chunk).
        "queue_order_strategy": "priority",
    }


class CeleryDispatcher:
    """The `Dispatcher` over Celery: ids only, JSON, never bytes; sent by task name."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        with producer_span(
            "kiln.chunk.send", job_id=job_id, chunk=chunk, items=len(item_ids), queue=queue
        ) as trace_headers:
            self.app.send_task(
                CHUNK_TASK,
                args=[job_id, chunk, item_ids],
                queue=queue,
                routing_key=queue,
                headers=trace_headers or None,  # the trace context, for the task's span
            )

    def enqueue_ingest(self, job_id: str, owner: str | None = None, countdown: float = 0) -> None:
        with producer_span("kiln.ingest.send", job_id=job_id) as trace_headers:
            self.app.send_task(
                INGEST_TASK,
                args=[job_id, owner],
                queue=INGEST,
                routing_key=INGEST,
                countdown=countdown or None,
                headers=trace_headers or None,
            )
