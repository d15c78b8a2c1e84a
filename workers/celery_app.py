"""`make_celery(settings)`: the Celery app for API producers, workers and `kiln run`."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from celery import Celery
from kombu.entity import Queue

from kiln.app.core.config import Settings
from kiln.app.observability.tracing import producer_span

if TYPE_CHECKING:
    from kiln.workers.batching import BatchStats
    from kiln.workers.chunk_stats import ChunkTotals
    from kiln.workers.runtime import WorkerRuntime

# In priority order: a worker takes interactive chunks before anything else, then ingest
# steps (short, and they keep bulk fed), then bulk chunks, then periodic control tasks.
QUEUES = ("interactive", "ingest", "bulk", "control")
WORK_QUEUES = QUEUES
CHUNK_TASK = "kiln.process_chunk"
INGEST_TASK = "kiln.ingest"


class KilnCelery(Celery):  # type: ignore[misc]
    """A Celery app that carries Kiln's settings and builds the worker runtime on demand."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("kiln", broker=settings.broker_url, set_as_current=False)
        self.settings = settings
        self.node_name = "embedded@localhost"  # `kiln worker` sets its Celery node name
        self._runtime: WorkerRuntime | None = None
        self._runtime_lock = threading.Lock()

    def runtime(self) -> WorkerRuntime:
        with self._runtime_lock:
            if self._runtime is None:
                from kiln.workers.runtime import WorkerRuntime

                self._runtime = WorkerRuntime(self.settings, self.node_name)
            return self._runtime

    def batch_stats(self) -> dict[str, BatchStats]:
        """Batching totals per model; empty until the runtime exists (never builds it)."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.batch_stats() if runtime else {}

    def chunk_totals(self) -> dict[str, ChunkTotals]:
        """Items and stage seconds per model; empty until the runtime exists."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.chunk_totals() if runtime else {}

    def backends(self) -> dict[str, str]:
        """The backend each loaded model runs on; empty until the runtime exists."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.backends() if runtime else {}

    def close_runtime(self) -> None:
        with self._runtime_lock:
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None


def make_celery(settings: Settings) -> KilnCelery:
    app = KilnCelery(settings)
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
        task_default_queue="interactive",
        task_queues=[Queue(name, routing_key=name) for name in QUEUES],  # type: ignore[no-untyped-call]
        task_create_missing_queues=False,
        broker_transport_options=_transport_options(settings),
        worker_send_task_events=True,
        task_send_sent_event=False,
        beat_schedule=_beat_schedule(settings),
    )
    if settings.embedded_broker:  # kombu's own loses a message a reader catches half-written
        app.conf.broker_transport = "kiln.workers.fs_transport:Transport"
    from kiln.workers import tasks

    tasks.register(app)
    return app


def _transport_options(settings: Settings) -> dict[str, Any]:
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


def _beat_schedule(settings: Settings) -> dict[str, Any]:
    """What `kiln beat` sends: the reconciler and the schedule tick, on the control queue."""
    control = {"queue": "control", "routing_key": "control", "expires": 60}
    return {
        "kiln-reconcile": {
            "task": "kiln.reconcile",
            "schedule": settings.reconcile_interval_s,
            "options": control,
        },
        "kiln-schedules": {
            "task": "kiln.run_schedules",
            "schedule": settings.schedule_tick_s,
            "options": control,
        },
    }


class CeleryDispatcher:
    """The `Dispatcher` the API and `kiln run` use: ids only, JSON, never bytes."""

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
                queue="ingest",
                routing_key="ingest",
                countdown=countdown or None,
                headers=trace_headers or None,
            )
