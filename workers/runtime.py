"""Everything heavy a worker process holds: DB engine, store, the prep processes, the lease
keeper, and per model its pipeline, shared-memory slots and Batcher.

Built lazily inside the process that uses it (never before a fork), and owned by the
Celery app object rather than a module global.

Models load on first use, each under its own lock: a multi-minute TensorRT build of one model
never stalls another model's batches. A model that failed to load is not tried again before
its backoff has passed (its chunks fail fast with the remembered reason). Loaded models are
bounded by the device-memory budget (`workers/runners/memory.py`): idle ones are unloaded, least
recently used first; and by time: one no chunk has used for `KILN_MODEL_IDLE_S` is unloaded by
a thread that looks every IDLE_CHECK_S (or half the setting). Problems the process cannot
recover from go to `health`, which its liveness probe reads (docs/gpu.md).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
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
from kiln.workers.batching import Batcher, BatchStats, Part
from kiln.workers.chunk.lease import Leases
from kiln.workers.chunk.stats import ChunkStats, ChunkTotals
from kiln.workers.engines.batch_size import choose_batch
from kiln.workers.engines.failures import BuildFailures
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Answers, AnswersShape, Batch, Pipeline, Rows
from kiln.workers.models.loader import load_pipeline
from kiln.workers.ops.health import EngineHealth, Health
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.pool import InlinePrep, Preparer, PrepPool, usable_cores
from kiln.workers.prep.slots import Lender, SlotPool, shm_free
from kiln.workers.prep.units import UNIT_ROWS
from kiln.workers.runners.memory import (
    ModelMemory,
    budget_bytes,
    engine_bytes,
    host_memory_bytes,
    rss_bytes,
    trim_host_memory,
)

# (batch shape) -> where to gather its pixels, or None: anywhere (ImageModelPipeline.pixel_buffer)
PixelBuffer = Callable[[tuple[int, ...]], np.ndarray | None]

log = logging.getLogger(__name__)

# Engine backend names (Engine.backend) that run on the GPU.
GPU_BACKENDS = ("tensorrt", "onnxruntime:CUDA", "torch:cuda")
QUEUED_BATCHES = 4  # decoded rows may run this many batches ahead of the engine
SLOT_BYTES = 512 * 2**20  # shared memory for one model's slots, at most (if a batch fits)
IDLE_CHECK_S = 30.0  # how often idle models are looked for, at most (KILN_MODEL_IDLE_S)


class ModelUnavailableError(KilnError):
    """The model failed to load recently; its items fail with the reason until the next try."""


@dataclass
class ModelRunner:
    info: ModelInfo
    pipeline: Pipeline
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
        """The shared memory of its slots (reserved whole when made): 0 for tickets."""
        slots = self.slots
        return slots.layout.nbytes * slots.count if slots is not None else 0

    def close(self) -> None:
        self.batcher.close()
        self.pipeline.close()
        self.lender.close()


def gather(
    parts: Sequence[Part[Rows]], slots: SlotPool | None, into: PixelBuffer | None = None
) -> Batch:
    """A batch's rows from the blocks it was cut from: pixels copied out of the slots in one
    take (the slots go back when their block settles) — into `into(shape)` when it gives a
    buffer (a GPU engine's pinned staging) — meta and objects joined."""
    pixels = None
    if slots is not None:
        taken = [p.block.slots[p.start : p.stop] for p in parts if p.block.slots is not None]
        indices = np.concatenate(taken)
        out = into((len(indices), *slots.layout.shape)) if into is not None else None
        pixels = slots.gather(indices, out)
    metas = [p.block.meta[p.start : p.stop] for p in parts if p.block.meta is not None]
    objects = [o for p in parts for o in (p.block.objects or [])[p.start : p.stop]]
    return Batch(
        pixels,
        np.concatenate(metas) if metas else None,
        objects if any(p.block.objects is not None for p in parts) else None,
    )


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
        self._leases: Leases | None = None
        self._prep: Preparer | None = None
        self._prep_lock = threading.Lock()
        self._progress = threading.Condition()  # notified as chunks finish (`kiln run` waits)
        self._chunks_done = 0
        self._idle_watch: threading.Thread | None = None  # started with the first model
        self._closing = threading.Event()

    def chunk_done(self, job_id: str) -> None:
        """A chunk of `job_id` has written its results."""
        with self._progress:
            self._chunks_done += 1
            self._progress.notify_all()

    def wait_for_chunk(self, seen: int, timeout: float) -> int:
        """Wait until a chunk finishes after the `seen`-th (or `timeout` passes); returns how
        many have finished in this process."""
        with self._progress:
            self._progress.wait_for(lambda: self._chunks_done != seen, timeout)
            return self._chunks_done

    @property
    def leases(self) -> Leases:
        """The process's one lease keeper, made on first use."""
        with self._prep_lock:
            if self._leases is None:
                s = self.settings
                self._leases = Leases(
                    self.sessions, s.lease_s, s.lease_renew_s, s.run_max_s, self.health,
                    cancel_check_s=s.cancel_check_s,
                )  # fmt: skip
            return self._leases

    def prep(self) -> Preparer:
        """The prep processes, started on first use (after any fork: they are spawned)."""
        with self._prep_lock:
            if self._prep is None:
                count = self.settings.prep_count(usable_cores())
                if count == 0:
                    self._prep = InlinePrep(self.settings, self.fetcher)
                else:
                    self._prep = PrepPool(self.settings, count)
                    log.info("%d prep processes started", count)
            return self._prep

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
        try:
            max_batch = self._batch_size(info, pipeline, engines)
            lender = self._lender(info, pipeline, max_batch, engines.runners)
        except Exception as error:  # built, but it cannot run here: let its memory go
            pipeline.close()
            memory.unload(info.cache_key)
            self.load_failures.record(info.cache_key, "load", str(error).rstrip("."))
            raise
        slots = lender if isinstance(lender, SlotPool) else None
        batcher = self._batcher(info, pipeline, max_batch, slots)
        runner = ModelRunner(info, pipeline, batcher, lender, size)
        device = self._report(info, pipeline, engines)
        log.info(
            "model %s ready on %s, %.0f MiB", info.ref, pipeline.backend, size / 2**20,
            extra={"model": info.ref, "backend": pipeline.backend, "device": device,
                   "max_batch": runner.batcher.max_batch},
        )  # fmt: skip
        return runner

    def _batch_size(self, info: ModelInfo, pipeline: Pipeline, engines: EngineFactory) -> int:
        """The model's batch: as configured, or under `auto` the knee of a short sweep of its
        GPU engine (16 on a CPU); never above what the engine was built for."""
        cap = pipeline.max_batch
        if self.settings.max_batch != "auto":
            return min(self.settings.max_batch, cap)
        gpu = [b.engine for b in engines.built if b.engine.backend.startswith(GPU_BACKENDS)]
        if len(engines.built) != 1 or not gpu:  # a CPU engine, or several (OCR's own sizes)
            return min(self.settings.batch_cap(on_gpu=bool(gpu)), cap)
        return choose_batch(gpu[0], cap, name=info.ref)

    def _lender(self, info: ModelInfo, pipeline: Pipeline, max_batch: int, runners: int) -> Lender:
        """What bounds the model's rows in prep and queued: enough for the batches queued and
        running and a unit or two per prep process. Slot families get shared-memory slots,
        within SLOT_BYTES and what /dev/shm has free (never fewer than a batch and a unit);
        object families get as many tickets, with one unit per prep process (their rows —
        OCR pages — can be large)."""
        prep = max(1, self.prep().processes)
        least = max_batch + UNIT_ROWS
        queued = QUEUED_BATCHES * max_batch * runners
        layout = pipeline.prep.layout
        if layout is None:
            return Lender(max(least, queued + UNIT_ROWS * prep))
        room = min(SLOT_BYTES, shm_free() // 2) // max(1, layout.nbytes)
        count = max(least, min(queued + 2 * UNIT_ROWS * prep, room))
        return SlotPool(layout, count, label=info.name)

    def _batcher(
        self, info: ModelInfo, pipeline: Pipeline, max_batch: int, slots: SlotPool | None
    ) -> Batcher[Rows, Answers]:
        runners = min(self.engines().runners, pipeline.max_runners)
        deadlines = self.settings.batch_deadlines
        deadline = deadlines.get(info.ref, deadlines.get(info.name, self.settings.batch_deadline_s))
        key = f"batch:{info.ref}"

        def wedged(sentence: str | None) -> None:
            if sentence is None:
                self.health.clear(key)
            else:
                self.health.fail(key, sentence)

        infer = traced_infer(pipeline.infer, model=info.ref, backend=pipeline.backend)

        into = getattr(pipeline, "pixel_buffer", None)

        def run(parts: Sequence[Part[Rows]]) -> Answers:
            return infer(gather(parts, slots, into))

        return Batcher(
            run,
            AnswersShape(),
            max_batch=max_batch,
            max_delay_s=self.settings.max_delay_s,
            runners=runners,
            name=f"batcher-{info.ref}",
            greedy=True,  # chunks announce their rows (see workers.chunk)
            max_queued=QUEUED_BATCHES * max_batch * runners,  # object rows (OCR pages) are big
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
        with self._prep_lock:
            prep = self._prep
        runners = self.runners().values()
        return EngineHealth(
            prep_processes=prep.processes if prep else 0,
            prep_replaced=prep.replaced if prep else 0,
            problems=self.health.problems(),
            memory={r.info.ref: r.memory_bytes for r in runners},
            slot_memory={r.info.ref: r.slot_bytes for r in runners},
            budget=memory.budget if memory else None,
            unloaded=memory.evictions if memory else 0,
            idle_unloaded=memory.idle_unloads if memory else 0,
            build_failures={key: f.attempts for key, f in failures.items()},
            rss_bytes=rss_bytes(),
            prep_rss_bytes=_prep_rss(prep.pids()) if prep else None,
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
        self._closing.set()
        with self._lock:
            watch = self._idle_watch
        if watch is not None:
            watch.join()
        if self._leases is not None:
            self._leases.close()
        for runner in self.runners().values():
            runner.close()
        with self._prep_lock:
            prep, self._prep = self._prep, None
        if prep is not None:
            prep.close()
        self.db.dispose()


def _prep_rss(pids: list[int]) -> int | None:
    """The prep processes' resident memory, summed; None when none could be read."""
    sizes = [size for size in map(rss_bytes, pids) if size is not None]
    return sum(sizes) if sizes else None


def _return_device_memory() -> None:
    """Hand memory an unloaded engine freed back to the device: CuPy and torch keep freed
    blocks in their pools, where another model's build cannot use them; and the heap it
    freed back to the system (`trim_host_memory`)."""
    trim_host_memory()
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
