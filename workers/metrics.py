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

from workers.batching import BatchStats
from workers.device import GpuTelemetry


class WorkerView(Protocol):
    """What the collectors read, at scrape time, from the worker (its Celery app)."""

    def batch_stats(self) -> Mapping[str, BatchStats]: ...

    def backends(self) -> Mapping[str, str]: ...


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


class BatcherCollector(Collector):
    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        stats = self.view.batch_stats()
        sizes = HistogramMetricFamily(
            "kiln_batch_size", "Rows per engine call (achieved batch size).", labels=["model"]
        )
        counters = {
            "rows": CounterMetricFamily(
                "kiln_batch_rows", "Rows run by the engine.", labels=["model"]
            ),
            "failed": CounterMetricFamily(
                "kiln_batch_failures", "Engine calls that raised (then split).", labels=["model"]
            ),
            "engine": CounterMetricFamily(
                "kiln_engine_seconds", "Time spent in engine calls.", labels=["model"]
            ),
            "wait": CounterMetricFamily(
                "kiln_batch_queue_wait_seconds",
                "Time rows waited in the Batcher's queue before their batch started.",
                labels=["model"],
            ),
        }
        for model, totals in stats.items():
            sizes.add_metric([model], batch_size_histogram(totals), sum_value=float(totals.rows))
            counters["rows"].add_metric([model], totals.rows)
            counters["failed"].add_metric([model], totals.failed_batches)
            counters["engine"].add_metric([model], totals.engine_seconds)
            counters["wait"].add_metric([model], totals.queue_wait_seconds)
        yield sizes
        yield from counters.values()


class EngineCollector(Collector):
    """`kiln_engine_info{model, backend} 1` for every model this worker has loaded."""

    def __init__(self, view: WorkerView) -> None:
        self.view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "kiln_engine_info", "The backend a model runs on here.", labels=["model", "backend"]
        )
        for model, backend in self.view.backends().items():
            info.add_metric([model, backend], 1.0)
        yield info


def worker_registry(view: WorkerView) -> CollectorRegistry:
    """Batching, engines and (where NVML answers) the GPUs of one worker process."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BatcherCollector(view))
    registry.register(EngineCollector(view))
    registry.register(GpuTelemetry())
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from other hosts
    start_http_server(port, addr=host, registry=registry)
