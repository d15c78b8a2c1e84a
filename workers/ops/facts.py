"""Worker facts for the console's fleet page, published through the database Kiln already has.

Every `PUBLISH_EVERY_S` a worker upserts one row (`app/db/worker_facts.py`): its device, each
loaded model's backend, owner, memory and batching totals, its health problems, its own and its
prep processes' resident memory, its capacity (usable cores and prep processes: what the
estimate before running takes a worker to run at once), and its GPU's latest NVML sample. The
API reads the rows seen recently (`app/api/fleet.py`); no port to open, no server to add. A GPU
figure NVML does not answer is absent from the sample, never zero.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.db import worker_facts as rows
from kiln.app.db.models import SHARED_TENANT, utcnow
from kiln.app.db.session import make_engine, make_session_factory, unit_of_work
from kiln.workers.batching import BatchStats
from kiln.workers.ops.device import Gpu, GpuTelemetry
from kiln.workers.ops.health import EngineHealth
from kiln.workers.ops.metrics import WorkerView
from kiln.workers.prep.pool import usable_cores

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 5.0


class FactsView(WorkerView, Protocol):
    """What a worker tells the fleet page, beyond its metrics."""

    def model_owners(self) -> Mapping[str, str]: ...


def batching(stats: BatchStats) -> dict[str, Any]:
    """Totals of one model's Batcher, with the two ratios the page shows."""
    return {
        "batches": stats.batches,
        "rows": stats.rows,
        "mean_batch": round(stats.mean_batch, 2),
        "engine_ms_per_batch": (
            round(1000 * stats.engine_seconds / stats.batches, 2) if stats.batches else None
        ),
        "failed_batches": stats.failed_batches,
    }


def model_facts(view: FactsView, health: EngineHealth | None = None) -> dict[str, dict[str, Any]]:
    """Per loaded model (its ref): backend, owner (for tenant scoping), what it holds (its
    engines' bytes, its slots' shared memory) and batching."""
    stats, backends, owners = view.batch_stats(), view.backends(), view.model_owners()
    health = health or EngineHealth()
    facts = {}
    for ref in sorted({*stats, *backends}):
        entry: dict[str, Any] = {
            "backend": backends.get(ref),
            "tenant": owners.get(ref, SHARED_TENANT),
        }
        if ref in health.memory:
            entry["memory_bytes"] = health.memory[ref]
        if ref in health.slot_memory:
            entry["slot_bytes"] = health.slot_memory[ref]
        if ref in stats:
            entry.update(batching(stats[ref]))
        facts[ref] = entry
    return facts


def gpu_sample(telemetry: GpuTelemetry, gpu: Gpu) -> dict[str, Any]:
    """The GPU's figures under the names the page charts; only those NVML answered."""
    read = telemetry.read(gpu)
    names = {"util": ("utilization_pct", 100.0), "used": ("memory_used_bytes", 1.0),
             "total": ("memory_total_bytes", 1.0), "temp": ("temperature_c", 1.0),
             "power": ("power_w", 1.0)}  # fmt: skip
    sample: dict[str, Any] = {"name": gpu.name, "index": gpu.index}
    for key, value in read.items():
        name, scale = names[key]
        sample[name] = round(value * scale, 2)
    return sample


def worker_facts(
    view: FactsView, telemetry: GpuTelemetry | None, capacity: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The JSON a worker publishes: models, problems, memory, its capacity when given and (on
    a GPU host) its device's sample. Memory figures the worker could not read are absent,
    never zero.

    A worker pinned to one GPU sees only that device; the first visible one runs its engines."""
    health = view.engine_health()
    memory = {"rss_bytes": health.rss_bytes, "prep_rss_bytes": health.prep_rss_bytes}
    facts: dict[str, Any] = {
        "models": model_facts(view, health),
        "problems": health.problems,
        "memory": {name: size for name, size in memory.items() if size is not None},
    }
    if capacity is not None:
        facts["capacity"] = dict(capacity)
    if telemetry is not None and telemetry.gpus:
        facts["gpu"] = gpu_sample(telemetry, telemetry.gpus[0])
    return facts


class FactsPublisher:
    """A thread that upserts this worker's facts every `interval_s` and deletes them on stop
    (then disposes of `engine`, which is its own).

    A failed write (the database restarting) is logged once and retried at the next tick: the
    fleet page showing a worker late never stops the worker."""

    def __init__(
        self,
        engine: Engine,
        worker: str,
        view: FactsView,
        telemetry: GpuTelemetry | None = None,
        interval_s: float = PUBLISH_EVERY_S,
        capacity: Mapping[str, int] | None = None,
    ) -> None:
        self.engine = engine  # its own: disposed on stop
        self.sessions = make_session_factory(engine)
        self.worker = worker
        self.view = view
        self.telemetry = telemetry
        self.interval_s = interval_s
        self.capacity = capacity
        self.host = socket.gethostname()
        gpus = telemetry.gpus if telemetry is not None else []
        self.device = gpus[0].name if gpus else "cpu"
        self.started_at: datetime = utcnow()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-facts", daemon=True)
        self._failing = False

    def start(self) -> FactsPublisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._write(lambda session: rows.forget(session, self.worker))
        self.engine.dispose()

    def publish(self) -> bool:
        """Write the facts now; returns whether the write went through."""
        facts = worker_facts(self.view, self.telemetry, self.capacity)
        return self._write(
            lambda session: rows.publish(
                session, self.worker, self.host, self.device, facts, self.started_at
            )
        )

    def _run(self) -> None:
        while True:
            self.publish()
            if self._stop.wait(self.interval_s):
                return

    def _write(self, change: Callable[[Session], None]) -> bool:
        try:
            with self.sessions() as session, unit_of_work(session):
                change(session)
        except SQLAlchemyError as error:
            if not self._failing:  # once per outage, not every tick
                log.warning("could not publish this worker's facts (the fleet page will show "
                            "it late): %s", error)  # fmt: skip
            self._failing = True
            return False
        if self._failing:
            log.info("worker facts published again")
        self._failing = False
        return True


def start_publishing(settings: Settings, worker: str, view: FactsView) -> FactsPublisher:
    """A publisher for `kiln worker`, on a one-connection pool of its own (a tick is one short
    upsert; it should never wait behind the task threads for a connection)."""
    engine = make_engine(settings.database_url, pool_size=1, max_overflow=0)
    cores = usable_cores()
    capacity = {"cores": cores, "prep_processes": settings.prep_count(cores)}
    return FactsPublisher(engine, worker, view, GpuTelemetry(), capacity=capacity).start()
