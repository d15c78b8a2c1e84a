"""The worker's Prometheus metrics, read back with prometheus_client's own parser."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.workers.batching import (
    SECONDS_BOUNDS,
    Batcher,
    BatchPolicy,
    BatchStats,
    ListShape,
    Part,
    seconds_bound,
)
from kiln.workers.ops.chunk_stats import ChunkTotals
from kiln.workers.ops.health import EngineHealth
from kiln.workers.ops.metrics import batch_size_histogram, size_buckets, worker_registry


@dataclass
class View:
    stats: dict[str, BatchStats]
    engines: dict[str, str]
    chunks: dict[str, ChunkTotals] = field(default_factory=dict)
    health: EngineHealth = field(default_factory=EngineHealth)

    def batch_stats(self) -> dict[str, BatchStats]:
        return self.stats

    def backends(self) -> dict[str, str]:
        return self.engines

    def chunk_totals(self) -> dict[str, ChunkTotals]:
        return self.chunks

    def engine_health(self) -> EngineHealth:
        return self.health


def rows_of(parts: Sequence[Part[list[int]]]) -> list[int]:
    return [row for part in parts for row in part.block[part.start : part.stop]]


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
    batcher: Batcher[list[int], list[int]] = Batcher(
        rows_of, ListShape(), BatchPolicy(max_batch=4, max_delay_s=0.5)
    )
    try:
        for future in [batcher.submit([i]) for i in range(10)]:  # ten blocks of one row
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


def test_seconds_bound_picks_the_smallest_holding_bucket() -> None:
    assert seconds_bound(0.0) == SECONDS_BOUNDS[0]
    assert seconds_bound(0.01) == 0.01
    assert seconds_bound(0.011) == 0.025
    assert seconds_bound(60.0) == float("inf")


def test_engine_and_queue_wait_histograms_count_batches_and_rows() -> None:
    batcher: Batcher[list[int], list[int]] = Batcher(
        rows_of, ListShape(), BatchPolicy(max_batch=4, max_delay_s=0.05)
    )
    try:
        blocks = [list(range(0, 3)), list(range(3, 10))]  # ten rows, cut across batches
        for future in [batcher.submit(block) for block in blocks]:
            future.result(timeout=5)
    finally:
        batcher.close()
    stats = batcher.snapshot()
    got = samples(generate_latest(worker_registry(View({"m": stats}, {}))).decode())
    model = (("model", "m"),)
    engine, wait = "kiln_batch_engine_duration_seconds", "kiln_batch_queue_wait_duration_seconds"
    assert got[(f"{engine}_count", model)] == stats.batches == got[("kiln_batch_size_count", model)]
    assert got[(f"{engine}_sum", model)] == stats.engine_seconds
    assert got[(f"{wait}_count", model)] == 10
    assert got[(f"{wait}_sum", model)] == stats.queue_wait_seconds
    buckets = [v for (name, labels), v in got.items() if name == f"{wait}_bucket"]
    assert len(buckets) == len(SECONDS_BOUNDS) + 1
    assert got[(f"{wait}_bucket", (("le", "+Inf"), ("model", "m")))] == 10


def test_health_memory_and_failed_builds_are_exported() -> None:
    health = EngineHealth(
        problems=["batcher-ocr: a batch of 4 has run for more than 300 s; the engine looks stuck."],
        memory={"resnet:1": 100 * 2**20},
        budget=2**30,
        unloaded=3,
        build_failures={("resnet:1", "tensorrt"): 2},
    )
    got = samples(generate_latest(worker_registry(View({}, {}, health=health))).decode())
    assert got[("kiln_worker_healthy", ())] == 0.0
    assert got[("kiln_model_memory_bytes", (("model", "resnet:1"),))] == 100 * 2**20
    assert got[("kiln_memory_budget_bytes", ())] == 2**30
    assert got[("kiln_models_unloaded_total", ())] == 3
    key = ("kiln_engine_build_failures", (("backend", "tensorrt"), ("model", "resnet:1")))
    assert got[key] == 2
    healthy = samples(generate_latest(worker_registry(View({}, {}))).decode())
    assert healthy[("kiln_worker_healthy", ())] == 1.0
    assert ("kiln_memory_budget_bytes", ()) not in healthy  # no model loaded yet
    assert ("kiln_worker_rss_bytes", ()) not in healthy  # not read: no series, never 0


def test_resident_memory_and_idle_unloads_are_exported() -> None:
    health = EngineHealth(
        memory={"ocr": 300 * 2**20},
        slot_memory={"ocr": 0, "phash": 2**17},
        idle_unloaded=2,
        rss_bytes=2500 * 2**20,
        prep_rss_bytes=600 * 2**20,
    )
    got = samples(generate_latest(worker_registry(View({}, {}, health=health))).decode())
    assert got[("kiln_worker_rss_bytes", ())] == 2500 * 2**20
    assert got[("kiln_prep_rss_bytes", ())] == 600 * 2**20
    assert got[("kiln_model_slot_bytes", (("model", "phash"),))] == 2**17
    assert got[("kiln_models_unloaded_idle_total", ())] == 2
    assert got[("kiln_models_unloaded_total", ())] == 0
