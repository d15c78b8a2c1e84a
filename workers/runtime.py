"""Everything heavy a worker process holds: DB engine, store, and one Batcher per model.

Built lazily inside the process that uses it (never before a fork), and owned by the
Celery app object rather than a module global.

Models load on first use, each under its own lock: a multi-minute TensorRT build of one model
never stalls another model's batches. A model that failed to load is not tried again before
its backoff has passed (its chunks fail fast with the remembered reason). Loaded models are
bounded by the device-memory budget (`workers/memory.py`): idle ones are unloaded, least
recently used first. Problems the process cannot recover from go to `health`, which its
liveness probe reads (docs/gpu.md).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import KilnError
from kiln.app.db import queries
from kiln.app.db.session import engine_for, make_session_factory, unit_of_work
from kiln.app.observability.tracing import traced_infer
from kiln.app.results import Place, place_for
from kiln.app.storage import ObjectStore, open_store
from kiln.workers.batching import Batcher, BatchStats
from kiln.workers.chunk.fetch import Fetcher
from kiln.workers.chunk.stats import ChunkStats, ChunkTotals
from kiln.workers.engines.failures import BuildFailures
from kiln.workers.engines.select import EngineFactory
from kiln.workers.health import EngineHealth, Health
from kiln.workers.memory import ModelMemory, budget_bytes, engine_bytes, host_memory_bytes
from kiln.workers.models.base import Pipeline, Prepared
from kiln.workers.models.loader import load_pipeline

log = logging.getLogger(__name__)

# Engine backend names (Engine.backend) that run on the GPU.
GPU_BACKENDS = ("tensorrt", "onnxruntime:CUDA", "torch:cuda")
QUEUED_BATCHES = 4  # decoded rows may run this many batches ahead of the engine


class ModelUnavailableError(KilnError):
    """The model failed to load recently; its items fail with the reason until the next try."""


@dataclass
class ModelRunner:
    info: ModelInfo
    pipeline: Pipeline
    batcher: Batcher[Prepared, Any]
    memory_bytes: int = 0


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
        self._lock = threading.Lock()  # the dicts only: never held while a model builds
        self._loading: dict[str, threading.Lock] = {}  # one per model being loaded
        self._engines: EngineFactory | None = None
        self._engines_lock = threading.Lock()
        self._memory: ModelMemory | None = None
        self.load_failures = BuildFailures(settings.engine_retry_s)
        self.health = Health()

    def place(self, job_id: str, output: str | None) -> Place:
        """Where this job's results go (Kiln's store, or the user's `output` prefix)."""
        return place_for(self.store, job_id, output, self.fetcher.s3_client)

    def runner(self, info: ModelInfo) -> ModelRunner:
        """The model's pipeline and Batcher, built on first use (one per process and weights:
        two tenants' identical registrations share one). Only loads of the same model wait
        for each other."""
        key = info.cache_key
        with self._lock:
            runner = self._runners.get(key)
            if runner is not None:
                return runner
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                runner = self._runners.get(key)
            if runner is None:
                runner = self._load(info)
                with self._lock:
                    self._runners[key] = runner
        return runner

    @contextmanager
    def using(self, info: ModelInfo) -> Iterator[ModelRunner]:
        """The model's runner, kept loaded (never unloaded) while the block runs."""
        memory, key = self.memory(), info.cache_key
        while True:
            runner = self.runner(info)
            with self._lock:  # as `_unload` checks: held, or unloaded before we could hold it
                if self._runners.get(key) is runner:
                    memory.acquire(key)
                    break
        try:
            yield runner
        finally:
            memory.release(key)

    def _load(self, info: ModelInfo) -> ModelRunner:
        held = self.load_failures.waiting(info.cache_key, "load")
        if held is not None:
            left = self.load_failures.seconds_left(held)
            raise ModelUnavailableError(f"{held.reason} (next try in {left:.0f} s)")
        memory = self.memory()
        self._unload(memory.victims(memory.sizes().get(info.cache_key, 0)))
        engines = self.engines().scoped()
        try:
            pipeline = load_pipeline(info, engines)
        except Exception as error:
            failure = self.load_failures.record(info.cache_key, "load", str(error).rstrip("."))
            wait = self.load_failures.seconds_left(failure)
            why = f"{failure.reason} (attempt {failure.attempts}, next try in {wait:.0f} s)"
            self._record_engine(info, "none", f"failed to load: {why}", "-")
            raise
        self.load_failures.forget(info.cache_key, "load")
        size = sum(engine_bytes(b.engine, b.onnx_path) for b in engines.built)
        try:
            self._unload(memory.victims(size, busy=[info.cache_key]))
        except KilnError as error:  # it is built: run it, over budget, rather than waste the build
            log.warning("model %s loads over the memory budget: %s", info.ref, error)
        memory.add(info.cache_key, size)
        runner = ModelRunner(info, pipeline, self._batcher(info, pipeline), size)
        device = self._report(info, pipeline, engines)
        log.info(
            "model %s ready on %s, %.0f MiB", info.ref, pipeline.backend, size / 2**20,
            extra={"model": info.ref, "backend": pipeline.backend, "device": device,
                   "max_batch": runner.batcher.max_batch},
        )  # fmt: skip
        return runner

    def _batcher(self, info: ModelInfo, pipeline: Pipeline) -> Batcher[Prepared, Any]:
        runners = min(self.engines().runners, pipeline.max_runners)
        max_batch = min(self.settings.max_batch, pipeline.max_batch)
        deadlines = self.settings.batch_deadlines
        deadline = deadlines.get(info.ref, deadlines.get(info.name, self.settings.batch_deadline_s))
        key = f"batch:{info.ref}"

        def wedged(sentence: str | None) -> None:
            if sentence is None:
                self.health.clear(key)
            else:
                self.health.fail(key, sentence)

        return Batcher(
            traced_infer(pipeline.infer, model=info.ref, backend=pipeline.backend),
            max_batch=max_batch,
            max_delay_s=self.settings.max_delay_s,
            runners=runners,
            name=f"batcher-{info.ref}",
            greedy=True,  # chunks announce their rows (see workers.chunk)
            max_queued=QUEUED_BATCHES * max_batch * runners,  # the model's batch: OCR rows are big
            deadline_s=deadline,
            on_wedged=wedged,
            oom_recovery_s=self.settings.oom_recovery_s,
        )

    def _unload(self, keys: list[str]) -> None:
        """Unload idle models to make room (the memory budget chose them)."""
        memory = self.memory()
        for key in keys:
            with self._lock:  # a chunk may have taken it up since it was chosen
                if memory.in_use(key):
                    continue
                runner = self._runners.pop(key, None)
                memory.unload(key)
            if runner is None:
                continue
            runner.batcher.close()
            runner.pipeline.close()
            log.info("model %s unloaded to stay within the memory budget (%.0f MiB freed)",
                     runner.info.ref, runner.memory_bytes / 2**20)  # fmt: skip
        if keys:
            _return_device_memory()

    def memory(self) -> ModelMemory:
        """The memory budget, sized from the best backend's device (made once)."""
        engines = self.engines()
        with self._engines_lock:
            if self._memory is None:
                gpus = engines.host.gpus
                device = gpus[0].memory_bytes if engines.choice.on_gpu else host_memory_bytes()
                self._memory = ModelMemory(budget_bytes(self.settings.device_memory_budget, device))
            return self._memory

    def _report(self, info: ModelInfo, pipeline: Pipeline, engines: EngineFactory) -> str:
        """Record which backend runs the model here, and why (`GET /v1/models` shows it);
        returns the device it runs on."""
        on_gpu = any(part.strip().startswith(GPU_BACKENDS) for part in pipeline.backend.split(","))
        device = ", ".join(g.name for g in engines.host.gpus) if on_gpu else "cpu"
        reasons = "; ".join(dict.fromkeys(b.engine.reason for b in engines.built))
        self._record_engine(info, pipeline.backend, reasons or "no engine", device)
        return device

    def _record_engine(self, info: ModelInfo, backend: str, reason: str, device: str) -> None:
        try:
            with self.sessions() as session, unit_of_work(session):
                queries.report_engine(session, self.node, info.ref, backend, reason, device)
        except SQLAlchemyError as error:  # a report is informative; never fail a job for it
            log.warning("could not record the engine of %s: %s", info.ref, error)

    def engines(self) -> EngineFactory:
        """Probed once, in this process (never before a fork): the backends models may use."""
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

    def engine_health(self) -> EngineHealth:
        """Problems, memory and failed builds, for metrics (never builds anything)."""
        with self._engines_lock:
            memory, engines = self._memory, self._engines
        failures = {
            **self.load_failures.snapshot(),
            **(engines.failures.snapshot() if engines else {}),
        }
        return EngineHealth(
            problems=self.health.problems(),
            memory={r.info.ref: r.memory_bytes for r in self.runners().values()},
            budget=memory.budget if memory else None,
            unloaded=memory.evictions if memory else 0,
            build_failures={key: f.attempts for key, f in failures.items()},
        )

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

    def model_owners(self) -> dict[str, str]:
        """The tenant each loaded model belongs to (the shared tenant for built-ins)."""
        return {r.info.ref: r.info.tenant for r in self.runners().values()}

    def close(self) -> None:
        for runner in self.runners().values():
            runner.batcher.close()
            runner.pipeline.close()
        self.db.dispose()


def _return_device_memory() -> None:
    """Hand memory an unloaded engine freed back to the device: CuPy and torch keep freed
    blocks in their pools, where another model's build cannot use them."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
