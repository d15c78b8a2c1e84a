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

from app.catalog import ModelInfo
from app.core.config import Settings
from app.db.session import make_engine, make_session_factory
from app.storage import ObjectStore, open_store
from workers.batching import Batcher
from workers.fetch import Fetcher
from workers.models.base import Pipeline, Prepared
from workers.models.loader import load_pipeline

log = logging.getLogger(__name__)


@dataclass
class ModelRunner:
    pipeline: Pipeline
    batcher: Batcher[Prepared, Any]


class WorkerRuntime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(settings.database_url)
        self.sessions: sessionmaker[Session] = make_session_factory(self.engine)
        self.store: ObjectStore = open_store(settings)
        self.fetcher = Fetcher(settings, self.store)
        self._runners: dict[str, ModelRunner] = {}
        self._lock = threading.Lock()

    def runner(self, info: ModelInfo) -> ModelRunner:
        """The model's pipeline and Batcher, built on first use (one per process)."""
        with self._lock:
            runner = self._runners.get(info.name)
            if runner is None:
                runner = self._build(info)
                self._runners[info.name] = runner
            return runner

    def _build(self, info: ModelInfo) -> ModelRunner:
        pipeline = load_pipeline(info, self.settings, self.store)
        batcher: Batcher[Prepared, Any] = Batcher(
            pipeline.infer,
            max_batch=min(self.settings.max_batch, pipeline.max_batch),
            max_delay_s=self.settings.max_delay_s,
            runners=self.settings.runners,
            name=f"batcher-{info.name}",
        )
        log.info("model %s ready on %s", info.name, pipeline.backend)
        return ModelRunner(pipeline, batcher)

    def runners(self) -> dict[str, ModelRunner]:
        with self._lock:
            return dict(self._runners)

    def close(self) -> None:
        for runner in self.runners().values():
            runner.batcher.close()
        self.engine.dispose()
