"""Prometheus metrics of a worker process, served on its own small HTTP port.

A collector reads the Batchers' running totals at scrape time, so the hot path pays nothing
and nothing global is registered: each worker process builds its own registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kiln.workers.batching import SECONDS_BOUNDS, BatchStats
from kiln.workers.ops.chunk_stats import ChunkTotals
from kiln.workers.ops.device import GpuTelemetry
from kiln.workers.ops.health import EngineHealth


class WorkerView(Protocol):
    """What the collectors read, at scrape time, from the worker (its Celery app)."""

    def batch_stats(self) -> Mapping[str, BatchStats]: ...

    def backends(self) -> Mapping[str, str]: ...

    def chunk_totals(self) -> Mapping[str, ChunkTotals]: ...

    def engine_health(self) -> EngineHealth: ...


def size_buckets(largest: int) -> list[int]:
    """Powers of two up to (and including) the largest batch seen."""
    bounds, bound = [], 1
    while bound < largest:
        bounds.append(bound)
        bound *= 2
    return [*bounds, bound]


def batch_size_histogram(stats: BatchStats) -> list[tuple[str, float]]:
    """Cumulative buckets `(le, count)` from the exact size counts the Batcher keeps."""
    largest = max(stats.size_counts, default=1)
    buckets = []
    for bound in size_buckets(largest):
        buckets.append(
            (
                str(float(bound)),
                float(sum(n for size, n in stats.size_counts.items() if size <= bound)),
            )
        )
    buckets.append(("+Inf", float(stats.batches)))
    return buckets


def seconds_histogram(counts: Mapping[float, int]) -> list[tuple[str, float]]:
    """Cumulative buckets over SECONDS_BOUNDS from counts keyed by bucket upper bound."""
    buckets, seen = [], 0
    for bound in SECONDS_BOUNDS:
        seen += counts.get(bound, 0)
        buckets.append((str(bound), float(seen)))
    buckets.append(("+Inf", float(sum(counts.values()))))
    return buckets


# The Batchers' running totals, per model: key → (metric, help).
BATCH_COUNTERS = {
    "rows": ("kiln_batch_rows", "Rows run by the engine."),
    "failed": ("kiln_batch_failures", "Engine calls that raised (then split)."),
    "oom": (
        "kiln_batch_out_of_memory",
        "Engine calls that ran out of memory (the batch cap shrank).",
    ),
    "expired": (
        "kiln_batch_deadline_expired",
        "Batches failed by the deadline watchdog: the engine was stuck.",
    ),
    "engine": ("kiln_engine_seconds", "Time spent in engine calls."),
    "wait": (
        "kiln_batch_queue_wait_seconds",
        "Time rows waited in the Batcher's queue before their batch started.",
    ),
}


class BatcherCollector(Collector):
    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        stats = self.view.batch_stats()
        sizes = HistogramMetricFamily(
            "kiln_batch_size", "Rows per engine call (achieved batch size).", labels=["model"]
        )
        engine = HistogramMetricFamily(
            "kiln_batch_engine_duration_seconds", "Engine time per batch.", labels=["model"]
        )
        wait = HistogramMetricFamily(
            "kiln_batch_queue_wait_duration_seconds",
            "Time each row waited in the Batcher's queue before its batch started.",
            labels=["model"],
        )
        counters = {
            key: CounterMetricFamily(name, text, labels=["model"])
            for key, (name, text) in BATCH_COUNTERS.items()
        }
        for model, totals in stats.items():
            sizes.add_metric([model], batch_size_histogram(totals), sum_value=float(totals.rows))
            engine.add_metric(
                [model], seconds_histogram(totals.engine_counts), totals.engine_seconds
            )
            wait.add_metric(
                [model], seconds_histogram(totals.wait_counts), totals.queue_wait_seconds
            )
            counters["rows"].add_metric([model], totals.rows)
            counters["failed"].add_metric([model], totals.failed_batches)
            counters["oom"].add_metric([model], totals.out_of_memory)
            counters["expired"].add_metric([model], totals.expired_batches)
            counters["engine"].add_metric([model], totals.engine_seconds)
            counters["wait"].add_metric([model], totals.queue_wait_seconds)
        yield from (sizes, engine, wait)
        yield from counters.values()


class ChunkCollector(Collector):
    """Items by final status, and seconds per stage of the chunks this worker ran."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[CounterMetricFamily]:
        chunks = CounterMetricFamily("kiln_chunks", "Chunks run to the end.", labels=["model"])
        items = CounterMetricFamily(
            "kiln_items", "Items finished, by final status.", labels=["model", "status"]
        )
        cached = CounterMetricFamily(
            "kiln_items_cached", "Items answered from the content cache.", labels=["model"]
        )
        stages = CounterMetricFamily(
            "kiln_stage_seconds",
            "Time chunks spent per stage: fetch (inputs, cache lookups), decode, "
            "infer (waiting for the engine, post-processing), write (results, counters).",
            labels=["model", "stage"],
        )
        for model, totals in self.view.chunk_totals().items():
            chunks.add_metric([model], totals.chunks)
            cached.add_metric([model], totals.cached)
            for status, count in sorted(totals.items.items()):
                items.add_metric([model, status], count)
            for stage, seconds in totals.seconds.items():
                stages.add_metric([model, stage], seconds)
        yield from (chunks, items, cached, stages)


class EngineCollector(Collector):
    """`kiln_engine_info{model, backend} 1` for every model this worker has loaded."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = GaugeMetricFamily(
            "kiln_engine_info", "The backend a model runs on here.", labels=["model", "backend"]
        )
        for model, backend in self.view.backends().items():
            info.add_metric([model, backend], 1.0)
        yield info
        yield from health_metrics(self.view.engine_health())


def health_metrics(health: EngineHealth) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Liveness, memory (the budget, each model's, the processes' resident memory) and failed
    builds."""
    yield GaugeMetricFamily(
        "kiln_worker_healthy",
        "1 while no engine is stuck and no run overran its lease (the liveness probe's view).",
        value=0.0 if health.problems else 1.0,
    )
    memory = GaugeMetricFamily(
        "kiln_model_memory_bytes",
        "Memory a loaded model's engines hold: the GPU's, or host memory on a CPU.",
        labels=["model"],
    )
    for model, size in health.memory.items():
        memory.add_metric([model], float(size))
    yield memory
    slots = GaugeMetricFamily(
        "kiln_model_slot_bytes",
        "Shared memory of a loaded model's prep slots (in the RSS of the worker and its prep "
        "processes alike).",
        labels=["model"],
    )
    for model, size in health.slot_memory.items():
        slots.add_metric([model], float(size))
    yield slots
    if health.rss_bytes is not None:
        yield GaugeMetricFamily(
            "kiln_worker_rss_bytes",
            "Resident memory of this worker process (the models, the Batchers, the slots).",
            value=health.rss_bytes,
        )
    if health.prep_rss_bytes is not None:
        yield GaugeMetricFamily(
            "kiln_prep_rss_bytes",
            "Resident memory of this worker's prep processes, summed.",
            value=health.prep_rss_bytes,
        )
    if health.budget is not None:
        yield GaugeMetricFamily(
            "kiln_memory_budget_bytes", "Device memory loaded models may hold.", value=health.budget
        )
    yield CounterMetricFamily(
        "kiln_models_unloaded", "Idle models unloaded to stay within the budget.", health.unloaded
    )
    yield CounterMetricFamily(
        "kiln_models_unloaded_idle",
        "Models unloaded because no chunk had used them for KILN_MODEL_IDLE_S.",
        health.idle_unloaded,
    )
    failures = GaugeMetricFamily(
        "kiln_engine_build_failures",
        "Failed builds in a row per model and backend ('load': every backend failed).",
        labels=["model", "backend"],
    )
    for (model, backend), attempts in health.build_failures.items():
        failures.add_metric([model, backend], float(attempts))
    yield failures
    yield GaugeMetricFamily(
        "kiln_prep_processes", "Processes decoding inputs for this worker.", health.prep_processes
    )
    yield CounterMetricFamily(
        "kiln_prep_processes_replaced",
        "Prep processes that died (killed, crashed on an input) and were replaced.",
        health.prep_replaced,
    )


def worker_registry(view: WorkerView) -> CollectorRegistry:
    """Batching, chunks, engines and (where NVML answers) the GPUs of one worker process."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BatcherCollector(view))
    registry.register(ChunkCollector(view))
    registry.register(EngineCollector(view))
    registry.register(GpuTelemetry())
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from other hosts
    start_http_server(port, addr=host, registry=registry)
