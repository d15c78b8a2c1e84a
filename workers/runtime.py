"""The resources one worker process holds, as a plain context: the database, the store and its
fetcher, the lease keeper, the prep processes, and the loaded models (`runners/`).

Built lazily inside the process that uses it (never before a fork), and owned by the Celery app
object rather than a module global. Each resource is made by its own factory; what a model's
loading, unloading and memory budget decide lives with the model runners. The prep processes
start with the first model that loads (their start-up overlaps its load), or the first unit.
Problems the process cannot recover from go to `health`, which its liveness probe reads
(docs/gpu.md).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.db.session import engine_for, make_session_factory
from kiln.app.jobs import fair_share
from kiln.app.results.results import Place, place_for
from kiln.app.storage import ObjectStore, open_store
from kiln.workers.batching import BatchStats
from kiln.workers.ops.chunk_stats import ChunkStats, ChunkTotals
from kiln.workers.ops.health import EngineHealth, Health
from kiln.workers.ops.keeper import Leases
from kiln.workers.ops.top_ups import TopUps
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.pool import InlinePrep, Preparer, PrepPool, usable_cores
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.runners.memory import rss_bytes
from kiln.workers.runners.runners import ModelRunners

log = logging.getLogger(__name__)


class WorkerRuntime:
    def __init__(self, settings: Settings, node: str = "embedded@localhost") -> None:
        self.settings = settings
        self.node = node  # the Celery node name, shown where engines are reported
        self.db = engine_for(settings)
        self.sessions: sessionmaker[Session] = make_session_factory(self.db)
        self.store: ObjectStore = open_store(settings)
        self.fetcher = Fetcher(PrepSettings.of(settings), self.store)
        self.chunk_stats = ChunkStats()  # items and stage seconds per model, chunks finished
        self.health = Health()
        self.prep: Preparer = _preparer(settings, self.fetcher)  # not started yet
        self.models = ModelRunners(
            settings, node, self.sessions, self.store, self.health, self._prep_for_model
        )
        self._infos: dict[tuple[str, str], ModelInfo] = {}
        self._leases: Leases | None = None
        self._top_ups: TopUps | None = None
        self._lock = threading.Lock()

    @property
    def leases(self) -> Leases:
        """The process's one lease keeper, made on first use."""
        with self._lock:
            if self._leases is None:
                s = self.settings
                self._leases = Leases(
                    self.sessions, s.lease_s, s.lease_renew_s, s.run_max_s, self.health,
                    cancel_check_s=s.cancel_check_s,
                )  # fmt: skip
            return self._leases

    def _prep_for_model(self) -> int:
        """How many prep processes feed a model that is loading; they start now, so their
        start-up overlaps the load (spawned: never forked from a process that may hold CUDA)."""
        self.prep.start()
        return self.prep.processes

    @property
    def top_ups(self) -> TopUps:
        """The process's fair-share top-up thread (workers/ops/top_ups.py), made on first use."""
        with self._lock:
            if self._top_ups is None:
                self._top_ups = TopUps(
                    lambda d: fair_share.top_up_quietly(self.sessions, d, self.settings)
                )
            return self._top_ups

    def use_prep(self, prep: Preparer) -> None:
        """Take over prep processes started before this runtime (`kiln run` starts them first,
        so their start-up overlaps its own: `prep/ahead.py`), in place of its own, which have
        not started; closed with the runtime."""
        with self._lock:
            if self.prep.pids():
                raise RuntimeError("This runtime's prep processes have already started.")
            own, self.prep = self.prep, prep
        own.close()
        log.info("%d prep processes started ahead, taken over", prep.processes)

    def place(self, job_id: str, output: str | None) -> Place:
        """Where this job's results go (Kiln's store, or the user's `output` prefix)."""
        return place_for(self.store, job_id, output, self.fetcher.s3_client)

    def model_info(self, session: Session, ref: str, tenant: str) -> ModelInfo:
        """What a job's model is, read once per process: a job pins `name:version`, and a
        registered version never changes."""
        with self._lock:
            info = self._infos.get((tenant, ref))
        if info is None:
            info = get_model(session, ref, tenant)
            with self._lock:
                self._infos[(tenant, ref)] = info
        return info

    def engine_health(self) -> EngineHealth:
        """Problems, memory and failed builds, for metrics (never builds anything)."""
        memory, engines = self.models.built()
        failures = {
            **self.models.load_failures.snapshot(),
            **(engines.failures.snapshot() if engines else {}),
        }
        prep, pids = self.prep, self.prep.pids()  # no pids: not started (or inline)
        runners = self.models.runners().values()
        return EngineHealth(
            prep_processes=prep.processes if pids else 0,
            prep_replaced=prep.replaced,
            problems=self.health.problems(),
            memory={r.info.ref: r.memory_bytes for r in runners},
            slot_memory={r.info.ref: r.slot_bytes for r in runners},
            budget=memory.budget if memory else None,
            unloaded=memory.evictions if memory else 0,
            idle_unloaded=memory.idle_unloads if memory else 0,
            build_failures={key: f.attempts for key, f in failures.items()},
            rss_bytes=rss_bytes(),
            prep_rss_bytes=_prep_rss(pids),
        )

    # What the worker says it holds (`ops.metrics.WorkerView`), for its metrics and facts.
    def batch_stats(self) -> dict[str, BatchStats]:
        return self.models.batch_stats()

    def backends(self) -> dict[str, str]:
        return self.models.backends()

    def model_owners(self) -> dict[str, str]:
        return self.models.model_owners()

    def chunk_totals(self) -> dict[str, ChunkTotals]:
        return self.chunk_stats.snapshot()

    def close(self) -> None:
        if self._leases is not None:
            self._leases.close()
        self.models.close()
        self.prep.close()
        self.db.dispose()


def _preparer(settings: Settings, fetcher: Fetcher) -> Preparer:
    """The prep processes this worker's cores allow, not started; none: prep on the chunk's
    thread (`KILN_PREP_PROCESSES=0`)."""
    count = settings.prep_count(usable_cores())
    return PrepPool(settings, count, start=False) if count else InlinePrep(settings, fetcher)


def _prep_rss(pids: list[int]) -> int | None:
    """The prep processes' resident memory, summed; None when none could be read."""
    sizes = [size for size in map(rss_bytes, pids) if size is not None]
    return sum(sizes) if sizes else None
