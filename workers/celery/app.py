"""`make_celery(settings)`: the worker's Celery app (`kiln worker`, `kiln beat`, `kiln run`)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from celery import Celery

from kiln.app.core.config import Settings
from kiln.app.dispatch.contract import CONTROL, RECONCILE_TASK, SCHEDULES_TASK, WEBHOOKS_TASK
from kiln.app.dispatch.producer import configure
from kiln.workers.celery import tasks
from kiln.workers.ops.health import EngineHealth
from kiln.workers.runners.memory import rss_bytes

if TYPE_CHECKING:
    from kiln.workers.batching import BatchStats
    from kiln.workers.ops.chunk_stats import ChunkTotals
    from kiln.workers.runtime import WorkerRuntime
    from kiln.workers.webhooks.courier import Courier


class KilnCelery(Celery):  # type: ignore[misc]
    """A Celery app that carries Kiln's settings and builds the worker runtime on demand."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("kiln", broker=settings.broker_url, set_as_current=False)
        self.settings = settings
        self.node_name = "embedded@localhost"  # `kiln worker` sets its Celery node name
        self._runtime: WorkerRuntime | None = None
        self._runtime_lock = threading.Lock()
        self._courier: Courier | None = None

    def _get_backend(self) -> Any:
        """Kiln keeps no results in Celery (`result_backend=None`): the disabled backend, made
        without Celery's look through every installed package's entry points for backends
        (per thread that asks: the sender, the consumer and each pool thread)."""
        if self.backend_cls is None and self.conf.result_backend is None:
            from celery.backends.base import DisabledBackend

            return DisabledBackend(app=self, url=None)
        return super()._get_backend()

    def runtime(self) -> WorkerRuntime:
        with self._runtime_lock:
            if self._runtime is None:
                from kiln.workers.runtime import WorkerRuntime

                self._runtime = WorkerRuntime(self.settings, self.node_name)
            return self._runtime

    def courier(self) -> Courier:
        """The process's webhook courier (built on first use, over the runtime's sessions)."""
        runtime = self.runtime()
        with self._runtime_lock:
            if self._courier is None:
                from kiln.workers.webhooks.courier import Courier

                self._courier = Courier(runtime.sessions, self.settings)
            return self._courier

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

    def model_owners(self) -> dict[str, str]:
        """The tenant of each loaded model; empty until the runtime exists."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.model_owners() if runtime else {}

    def engine_health(self) -> EngineHealth:
        """Problems, memory and failed builds; only the process's RSS until the runtime
        exists."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.engine_health() if runtime else EngineHealth(rss_bytes=rss_bytes())

    def health_problems(self) -> list[str]:
        """What keeps this worker from working (a stuck engine, an overlong run); empty until
        the runtime exists."""
        with self._runtime_lock:
            runtime = self._runtime
        return runtime.health.problems() if runtime else []

    def close_runtime(self) -> None:
        with self._runtime_lock:
            if self._courier is not None:
                self._courier.stop()
                self._courier = None
            if self._runtime is not None:
                self._runtime.close()
                self._runtime = None


def make_celery(settings: Settings) -> KilnCelery:
    """The worker's app: the producers' configuration, beat's schedule and the task adapters."""
    app = KilnCelery(settings)
    configure(app, settings)
    app.conf.beat_schedule = _beat_schedule(settings)
    tasks.register(app, app.runtime, app.courier)
    return app


def _beat_schedule(settings: Settings) -> dict[str, Any]:
    """What `kiln beat` sends: the reconciler, the schedule tick and the webhooks' sweep, on
    the control queue."""
    control = {"queue": CONTROL, "routing_key": CONTROL, "expires": 60}
    return {
        "kiln-reconcile": {
            "task": RECONCILE_TASK,
            "schedule": settings.reconcile_interval_s,
            "options": control,
        },
        "kiln-schedules": {
            "task": SCHEDULES_TASK,
            "schedule": settings.schedule_tick_s,
            "options": control,
        },
        "kiln-webhooks": {
            "task": WEBHOOKS_TASK,
            "schedule": settings.webhook_sweep_s,
            "options": control,
        },
    }
