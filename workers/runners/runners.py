"""The models a worker process has loaded: per model its predictor, shared-memory slots and
Batcher (a `ModelRunner`), loaded on first use and unloaded when the memory budget or idleness
says so.

Models load on first use, each under its own lock: a multi-minute TensorRT build of one model
never stalls another model's batches. A model that failed to load is not tried again before
its backoff has passed (its chunks fail fast with the remembered reason). Loaded models are
bounded by the device-memory budget (`memory.py`): idle ones are unloaded, least recently used
first; and by time: one no chunk has used for `KILN_MODEL_IDLE_S` is unloaded by a thread that
looks every IDLE_CHECK_S (or half the setting). Which backend runs each model, and why, is
reported to the database (`GET /v1/models` shows it).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.app.core.errors import KilnError
from kiln.app.db import queries
from kiln.app.db.session import unit_of_work
from kiln.app.storage import ObjectStore
from kiln.workers.batching import Batcher, BatchStats
from kiln.workers.engines.failures import BuildFailures
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Answers, Predictor, Rows
from kiln.workers.models.loader import load_predictor
from kiln.workers.ops.health import Health
from kiln.workers.prep.slots import ByteSlots, Lender, SlotPool
from kiln.workers.runners import sizing
from kiln.workers.runners.build import model_batcher
from kiln.workers.runners.memory import (
    ModelMemory,
    budget_bytes,
    engine_bytes,
    host_memory_bytes,
    trim_host_memory,
)

log = logging.getLogger(__name__)

IDLE_CHECK_S = 30.0  # how often idle models are looked for, at most (KILN_MODEL_IDLE_S)


class ModelUnavailableError(KilnError):
    """The model failed to load recently; its items fail with the reason until the next try."""


@dataclass
class ModelRunner:
    info: ModelInfo
    predictor: Predictor
    batcher: Batcher[Rows, Answers]
    # What bounds this model's rows in prep and queued: its shared-memory slots (slot
    # families), or tickets without memory (rows that travel as objects).
    lender: Lender
    memory_bytes: int = 0

    @property
    def slots(self) -> SlotPool | None:
        return self.lender if isinstance(self.lender, SlotPool) else None

    @property
    def slot_bytes(self) -> int:
        """The shared memory of its slots, pixels or bytes (reserved whole when made): 0 for
        tickets."""
        lent = self.lender
        return lent.layout.nbytes * lent.count if isinstance(lent, SlotPool | ByteSlots) else 0

    def close(self) -> None:
        self.batcher.close()
        self.predictor.close()
        self.lender.close()


class ModelRunners:
    """The loaded models of one process. `prep_processes` says how many prep processes feed
    them (slots are sized for it); `health` takes a wedged Batcher's sentence."""

    def __init__(
        self,
        settings: Settings,
        node: str,
        sessions: sessionmaker[Session],
        store: ObjectStore,
        health: Health,
        prep_processes: Callable[[], int],
    ) -> None:
        self.settings, self.node, self.health = settings, node, health
        self._sessions, self._store, self._prep_processes = sessions, store, prep_processes
        self.load_failures = BuildFailures(settings.engine_retry_s)
        self._runners: dict[str, ModelRunner] = {}
        self._lock = threading.Lock()  # the dict only: never held while a model builds
        self._loading: dict[str, threading.Lock] = {}  # one per model being loaded
        self._engines: EngineFactory | None = None
        self._memory: ModelMemory | None = None
        self._engines_lock = threading.Lock()
        self._idle_watch: threading.Thread | None = None  # started with the first model
        self._closing = threading.Event()

    def runner(self, info: ModelInfo) -> ModelRunner:
        """The model's predictor and Batcher, built on first use (one per process and weights:
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
                _freeze_heap()
                self._watch_idle()
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
            predictor = load_predictor(info, engines)
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
        try:
            runner = self._runner(info, predictor, engines, size)
        except Exception as error:  # built, but it cannot run here: let its memory go
            predictor.close()
            memory.unload(info.cache_key)
            self.load_failures.record(info.cache_key, "load", str(error).rstrip("."))
            raise
        device = self._report(info, predictor, engines)
        log.info(
            "model %s ready on %s, %.0f MiB", info.ref, predictor.backend, size / 2**20,
            extra={"model": info.ref, "backend": predictor.backend, "device": device,
                   "max_batch": runner.batcher.max_batch},
        )  # fmt: skip
        return runner

    def _runner(
        self, info: ModelInfo, predictor: Predictor, engines: EngineFactory, size: int
    ) -> ModelRunner:
        """The loaded predictor's batch size, slots and Batcher."""
        max_batch = sizing.batch_size(self.settings, info, predictor, engines)
        runners = sizing.batch_runners(self.engines().runners, predictor)
        lender = sizing.lender(info, predictor, max_batch, runners, self._prep_processes())
        slots = lender if isinstance(lender, SlotPool) else None
        key = f"batch:{info.ref}"

        def wedged(sentence: str | None) -> None:
            if sentence is None:
                self.health.clear(key)
            else:
                self.health.fail(key, sentence)

        batcher = model_batcher(
            self.settings, info.ref, info.name, predictor, max_batch, runners, slots, wedged
        )
        return ModelRunner(info, predictor, batcher, lender, size)

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
            runner.close()
            log.info("model %s unloaded to stay within the memory budget (%.0f MiB freed)",
                     runner.info.ref, runner.memory_bytes / 2**20)  # fmt: skip
        if keys:
            _return_device_memory()

    def unload_idle(self) -> list[str]:
        """Unload the models no chunk has used for `KILN_MODEL_IDLE_S` (never one in use):
        their engines, Batcher and shared-memory slots go, and the memory goes back to the
        device and the system. Returns their refs."""
        idle_s = self.settings.model_idle_s
        with self._engines_lock:
            memory = self._memory
        if idle_s <= 0 or memory is None:
            return []
        with self._lock:  # as `using` takes a model up: chosen and taken out in one step
            keys = [key for key in memory.idle(idle_s) if key in self._runners]
            runners = [self._runners.pop(key) for key in keys]
            for key in keys:
                memory.unload(key, idle=True)
        for runner in runners:
            runner.close()
            log.info("model %s unloaded after %g s unused (%.0f MiB, %.0f MiB of slots freed)",
                     runner.info.ref, idle_s, runner.memory_bytes / 2**20,
                     runner.slot_bytes / 2**20, extra={"model": runner.info.ref})  # fmt: skip
        if runners:
            _return_device_memory()
        return [runner.info.ref for runner in runners]

    def _watch_idle(self) -> None:
        """Start the thread that unloads idle models (once, when a model has loaded)."""
        idle_s = self.settings.model_idle_s
        if idle_s <= 0:
            return
        with self._lock:
            if self._idle_watch is not None or self._closing.is_set():
                return
            every = min(IDLE_CHECK_S, idle_s / 2)
            self._idle_watch = threading.Thread(
                target=self._watch, args=(every,), name="kiln-idle-models", daemon=True
            )
            self._idle_watch.start()

    def _watch(self, every: float) -> None:
        while not self._closing.wait(every):
            try:
                self.unload_idle()
            except Exception:  # the next look tries again; never let the thread die
                log.exception("could not unload idle models")

    def memory(self) -> ModelMemory:
        """The memory budget, sized from the best backend's device (made once)."""
        engines = self.engines()
        with self._engines_lock:
            if self._memory is None:
                gpus = engines.host.gpus
                device = gpus[0].memory_bytes if engines.choice.on_gpu else host_memory_bytes()
                self._memory = ModelMemory(budget_bytes(self.settings.device_memory_budget, device))
            return self._memory

    def engines(self) -> EngineFactory:
        """Probed once, in this process (never before a fork): the backends models may use."""
        with self._engines_lock:
            if self._engines is None:
                self._engines = EngineFactory(self.settings, self._store)
            return self._engines

    def built(self) -> tuple[ModelMemory | None, EngineFactory | None]:
        """The memory budget and the engine factory if made (never makes them)."""
        with self._engines_lock:
            return self._memory, self._engines

    def _report(self, info: ModelInfo, predictor: Predictor, engines: EngineFactory) -> str:
        """Record which backend runs the model here, and why; returns its device."""
        gpu = sizing.on_gpu(predictor.backend)
        device = ", ".join(g.name for g in engines.host.gpus) if gpu else "cpu"
        reasons = "; ".join(dict.fromkeys(b.engine.reason for b in engines.built))
        self._record_engine(info, predictor.backend, reasons or "no engine", device)
        return device

    def _record_engine(self, info: ModelInfo, backend: str, reason: str, device: str) -> None:
        try:
            with self._sessions() as session, unit_of_work(session):
                queries.report_engine(session, self.node, info.ref, backend, reason, device)
        except SQLAlchemyError as error:  # a report is informative; never fail a job for it
            log.warning("could not record the engine of %s: %s", info.ref, error)

    def runners(self) -> dict[str, ModelRunner]:
        with self._lock:
            return dict(self._runners)

    def batch_stats(self) -> dict[str, BatchStats]:
        """Batching totals per model (`name` or `name:version`)."""
        return {r.info.ref: r.batcher.snapshot() for r in self.runners().values()}

    def backends(self) -> dict[str, str]:
        """The backend each loaded model runs on."""
        return {r.info.ref: r.predictor.backend for r in self.runners().values()}

    def model_owners(self) -> dict[str, str]:
        """The tenant each loaded model belongs to (the shared tenant for built-ins)."""
        return {r.info.ref: r.info.tenant for r in self.runners().values()}

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            watch = self._idle_watch
        if watch is not None:
            watch.join()
        for runner in self.runners().values():
            runner.close()


def _freeze_heap() -> None:
    """After a model loads: what the process holds now (the modules its engine imported —
    torch's are ~200,000 objects — and what the load built) lives as long as the model, so the
    cycle collector's passes need not walk it. Unfrozen, every full pass (one every few
    hundred rows, holding the GIL) walked it all: four of ~60 ms of CPU each in a 2,000-row
    stand-in `kiln run`. An unload thaws the heap (`_return_device_memory`), so the unloaded
    model's cycles can be collected, and the next load freezes again."""
    gc.freeze()


def _return_device_memory() -> None:
    """Hand memory an unloaded engine freed back to the device: CuPy and torch keep freed
    blocks in their pools, where another model's build cannot use them; and the heap it
    freed back to the system (`trim_host_memory`)."""
    gc.unfreeze()  # the unloaded model's cycles may be collected (`_freeze_heap`)
    trim_host_memory()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
