"""Prometheus metrics of a worker process, served on its own small HTTP port.

A collector reads the Batchers' running totals at scrape time, so the hot path pays nothing
and nothing global is registered: each worker process builds its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from workers.batching import BatchStats

StatsSource = Callable[[], Mapping[str, BatchStats]]  # model name -> totals


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
    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        stats = self.source()
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


def worker_registry(source: StatsSource) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(BatcherCollector(source))
    return registry


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from other hosts
    start_http_server(port, addr=host, registry=registry)
