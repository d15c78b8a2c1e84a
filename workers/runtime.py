"""Everything heavy a worker process holds: DB engine, store, and one Batcher per model.

Built lazily inside the process that uses it (never before a fork), and owned by the
Celery app object rather than a module global.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.catalog import ModelInfo, get_model
from app.core.config import Settings
from app.db.session import engine_for, make_session_factory
from app.storage import ObjectStore, open_store
from workers.batching import Batcher, BatchStats
from workers.engines.select import EngineFactory
from workers.fetch import Fetcher
from workers.models.base import Pipeline, Prepared
from workers.models.loader import load_pipeline

log = logging.getLogger(__name__)

QUEUED_BATCHES = 4  # decoded rows may run this many batches ahead of the engine


@dataclass
class ModelRunner:
    pipeline: Pipeline
    batcher: Batcher[Prepared, Any]


class WorkerRuntime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = engine_for(settings)
        self.sessions: sessionmaker[Session] = make_session_factory(self.engine)
        self.store: ObjectStore = open_store(settings)
        self.fetcher = Fetcher(settings, self.store)
        self._runners: dict[str, ModelRunner] = {}
        self._models: dict[str, ModelInfo] = {}
        self._lock = threading.Lock()
        self._engines: EngineFactory | None = None
        self._engines_lock = threading.Lock()

    def runner(self, info: ModelInfo) -> ModelRunner:
        """The model's pipeline and Batcher, built on first use (one per process)."""
        with self._lock:
            runner = self._runners.get(info.name)
            if runner is None:
                runner = self._build(info)
                self._runners[info.name] = runner
            return runner

    def _build(self, info: ModelInfo) -> ModelRunner:
        pipeline = load_pipeline(info, self.engines())
        runners = min(self.engines().runners, pipeline.max_runners)
        batcher: Batcher[Prepared, Any] = Batcher(
            pipeline.infer,
            max_batch=min(self.settings.max_batch, pipeline.max_batch),
            max_delay_s=self.settings.max_delay_s,
            runners=runners,
            name=f"batcher-{info.name}",
            greedy=True,  # chunks announce their rows (see workers.chunk)
            max_queued=QUEUED_BATCHES * self.settings.max_batch * runners,
        )
        log.info("model %s ready on %s, %d runner(s)", info.name, pipeline.backend, runners)
        return ModelRunner(pipeline, batcher)

    def engines(self) -> EngineFactory:
        """Probed once, in this process (never before a fork): the backend every model uses."""
        with self._engines_lock:
            if self._engines is None:
                self._engines = EngineFactory(self.settings, self.store)
            return self._engines

    def model_info(self, session: Session, name: str) -> ModelInfo:
        """What a job's model is, read once per process: a registered model never changes
        under its name (registering a name twice is refused)."""
        with self._lock:
            info = self._models.get(name)
        if info is None:
            info = get_model(session, name)
            with self._lock:
                self._models[name] = info
        return info

    def runners(self) -> dict[str, ModelRunner]:
        with self._lock:
            return dict(self._runners)

    def batch_stats(self) -> dict[str, BatchStats]:
        return {name: runner.batcher.snapshot() for name, runner in self.runners().items()}

    def close(self) -> None:
        for runner in self.runners().values():
            runner.batcher.close()
            runner.pipeline.close()
        self.engine.dispose()
