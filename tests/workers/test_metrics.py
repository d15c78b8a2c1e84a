"""The worker's Prometheus metrics, read back with prometheus_client's own parser."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workers.batching import Batcher, BatchStats
from workers.metrics import batch_size_histogram, size_buckets, worker_registry


@dataclass
class View:
    stats: dict[str, BatchStats]
    engines: dict[str, str]

    def batch_stats(self) -> dict[str, BatchStats]:
        return self.stats

    def backends(self) -> dict[str, str]:
        return self.engines


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_size_buckets_are_powers_of_two_covering_the_largest() -> None:
    assert size_buckets(1) == [1]
    assert size_buckets(5) == [1, 2, 4, 8]
    assert size_buckets(16) == [1, 2, 4, 8, 16]


def test_histogram_buckets_are_cumulative() -> None:
    stats = BatchStats(batches=4, rows=13, size_counts=Counter({1: 1, 3: 1, 4: 1, 5: 1}))
    assert batch_size_histogram(stats) == [
        ("1.0", 1.0),
        ("2.0", 1.0),
        ("4.0", 3.0),
        ("8.0", 4.0),
        ("+Inf", 4.0),
    ]


def test_no_runtime_yet_means_no_series() -> None:
    text = generate_latest(worker_registry(View({}, {}))).decode()
    assert "kiln_batch_size_count{" not in text


def test_a_batchers_totals_are_exported() -> None:
    batcher: Batcher[int, int] = Batcher(lambda rows: list(rows), max_batch=4, max_delay_s=0.5)
    try:
        for future in batcher.submit_many(range(10)):
            future.result(timeout=5)
    finally:
        batcher.close()
    stats = batcher.snapshot()
    view = View({"resnet": stats}, {"resnet": "onnxruntime:CPUExecutionProvider"})
    got = samples(generate_latest(worker_registry(view)).decode())
    model = (("model", "resnet"),)
    assert got[("kiln_batch_size_count", model)] == stats.batches
    assert got[("kiln_batch_size_sum", model)] == 10
    assert got[("kiln_batch_rows_total", model)] == 10
    assert got[("kiln_batch_failures_total", model)] == 0
    assert got[("kiln_engine_seconds_total", model)] >= 0
    assert got[("kiln_batch_size_bucket", (("le", "+Inf"), ("model", "resnet")))] == stats.batches
    backend = (("backend", "onnxruntime:CPUExecutionProvider"), ("model", "resnet"))
    assert got[("kiln_engine_info", backend)] == 1
    assert not any(name.startswith("kiln_gpu_") for name, _labels in got)  # no GPU: absent
