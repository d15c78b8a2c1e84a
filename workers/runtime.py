"""Everything heavy a worker process holds: DB engine, store, and one Batcher per model.

Built lazily inside the process that uses it (never before a fork), and owned by the
Celery app object rather than a module global.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.db import queries
from kiln.app.db.session import engine_for, make_session_factory, unit_of_work
from kiln.app.observability.tracing import traced_infer
from kiln.app.results import Place, place_for
from kiln.app.storage import ObjectStore, open_store
from kiln.workers.batching import Batcher, BatchStats
from kiln.workers.chunk.fetch import Fetcher
from kiln.workers.chunk.stats import ChunkStats, ChunkTotals
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Pipeline, Prepared
from kiln.workers.models.loader import load_pipeline

log = logging.getLogger(__name__)

QUEUED_BATCHES = 4  # decoded rows may run this many batches ahead of the engine


@dataclass
class ModelRunner:
    info: ModelInfo
    pipeline: Pipeline
    batcher: Batcher[Prepared, Any]


class WorkerRuntime:
    def __init__(self, settings: Settings, node: str = "embedded@localhost") -> None:
        self.settings = settings
        self.node = node  # the Celery node name, shown where engines are reported
        self.db = engine_for(settings)
        self.sessions: sessionmaker[Session] = make_session_factory(self.db)
        self.store: ObjectStore = open_store(settings)
        self.fetcher = Fetcher(settings, self.store)
        self.chunk_stats = ChunkStats()  # items and stage seconds per model, for metrics
        self._runners: dict[str, ModelRunner] = {}
        self._models: dict[tuple[str, str], ModelInfo] = {}
        self._lock = threading.Lock()
        self._engines: EngineFactory | None = None
        self._engines_lock = threading.Lock()

    def place(self, job_id: str, output: str | None) -> Place:
        """Where this job's results go (Kiln's store, or the user's `output` prefix)."""
        return place_for(self.store, job_id, output, self.fetcher.s3_client)

    def runner(self, info: ModelInfo) -> ModelRunner:
        """The model's pipeline and Batcher, built on first use (one per process and weights:
        two tenants' identical registrations share one)."""
        with self._lock:
            runner = self._runners.get(info.cache_key)
            if runner is None:
                runner = self._build(info)
                self._runners[info.cache_key] = runner
        return runner

    def _build(self, info: ModelInfo) -> ModelRunner:
        pipeline = load_pipeline(info, self.engines())
        runners = min(self.engines().runners, pipeline.max_runners)
        max_batch = min(self.settings.max_batch, pipeline.max_batch)
        batcher: Batcher[Prepared, Any] = Batcher(
            traced_infer(pipeline.infer, model=info.ref, backend=pipeline.backend),
            max_batch=max_batch,
            max_delay_s=self.settings.max_delay_s,
            runners=runners,
            name=f"batcher-{info.ref}",
            greedy=True,  # chunks announce their rows (see workers.chunk)
            max_queued=QUEUED_BATCHES * max_batch * runners,  # the model's batch: OCR rows are big
        )
        device = self._report(info, pipeline)
        log.info(
            "model %s ready on %s, %d runner(s)", info.ref, pipeline.backend, runners,
            extra={"model": info.ref, "backend": pipeline.backend, "device": device,
                   "max_batch": max_batch},
        )  # fmt: skip
        return ModelRunner(info, pipeline, batcher)

    def _report(self, info: ModelInfo, pipeline: Pipeline) -> str:
        """Record which backend runs the model here, and why (`GET /v1/models` shows it);
        returns the device it runs on."""
        engines = self.engines()
        device = ", ".join(g.name for g in engines.host.gpus) if engines.choice.on_gpu else "cpu"
        try:
            with self.sessions() as session, unit_of_work(session):
                queries.report_engine(
                    session, self.node, info.ref, pipeline.backend, engines.choice.reason, device
                )
        except SQLAlchemyError as error:  # a report is informative; never fail a job for it
            log.warning("could not record the engine of %s: %s", info.ref, error)
        return device

    def engines(self) -> EngineFactory:
        """Probed once, in this process (never before a fork): the backend every model uses."""
        with self._engines_lock:
            if self._engines is None:
                self._engines = EngineFactory(self.settings, self.store)
            return self._engines

    def model_info(self, session: Session, ref: str, tenant: str) -> ModelInfo:
        """What a job's model is, read once per process: a job pins `name:version`, and a
        registered version never changes."""
        with self._lock:
            info = self._models.get((tenant, ref))
        if info is None:
            info = get_model(session, ref, tenant)
            with self._lock:
                self._models[(tenant, ref)] = info
        return info

    def runners(self) -> dict[str, ModelRunner]:
        with self._lock:
            return dict(self._runners)

    def batch_stats(self) -> dict[str, BatchStats]:
        """Batching totals per model (`name` or `name:version`)."""
        return {r.info.ref: r.batcher.snapshot() for r in self.runners().values()}

    def chunk_totals(self) -> dict[str, ChunkTotals]:
        """Items by final status and seconds per stage, per model."""
        return self.chunk_stats.snapshot()

    def backends(self) -> dict[str, str]:
        """The backend each loaded model runs on."""
        return {r.info.ref: r.pipeline.backend for r in self.runners().values()}

    def close(self) -> None:
        for runner in self.runners().values():
            runner.batcher.close()
            runner.pipeline.close()
        self.db.dispose()
