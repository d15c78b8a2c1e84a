"""Items by status and stage seconds: recorded once per chunk run, exported by the worker."""

from __future__ import annotations

from collections import Counter

from prometheus_client import generate_latest

from kiln.workers.batching import BatchStats
from kiln.workers.ops.chunk_stats import STAGES, ChunkStats, ChunkTotals
from kiln.workers.ops.metrics import worker_registry
from kiln.workers.runtime import WorkerRuntime
from tests.workers.chunk.test_run import run_all, submit
from tests.workers.test_metrics import View, samples


def test_totals_add_up_per_model() -> None:
    stats = ChunkStats()
    stats.record("m", {"succeeded": 2, "failed": 1}, {"fetch": 0.5, "infer": 1.0}, cached=1)
    stats.record("m", {"succeeded": 3}, {"fetch": 0.25})
    totals = stats.snapshot()["m"]
    assert totals.chunks == 2
    assert totals.cached == 1
    assert totals.items == Counter({"succeeded": 5, "failed": 1})
    assert totals.seconds == {"fetch": 0.75, "decode": 0.0, "infer": 1.0, "write": 0.0}


def test_a_chunk_run_records_items_and_every_stage(runtime: WorkerRuntime) -> None:
    _job_id, calls = submit(runtime)  # 5 files, one of them not an image
    reports = run_all(runtime, calls)
    assert all(set(r.seconds) == set(STAGES) for r in reports)
    assert all(r.seconds["write"] > 0 and r.seconds["infer"] >= 0 for r in reports)
    [(model, totals)] = runtime.chunk_totals().items()
    assert totals.chunks == len(calls)
    assert totals.items == Counter({"succeeded": 4, "failed": 1})
    assert sum(runtime.batch_stats()[model].size_counts.values()) > 0


def test_chunk_series_are_exported() -> None:
    totals = ChunkTotals(2, 1, Counter({"succeeded": 5, "failed": 1}), dict.fromkeys(STAGES, 0.5))
    view = View({"m": BatchStats()}, {}, {"m": totals})
    got = samples(generate_latest(worker_registry(view)).decode())
    assert got[("kiln_chunks_total", (("model", "m"),))] == 2
    assert got[("kiln_items_cached_total", (("model", "m"),))] == 1
    assert got[("kiln_items_total", (("model", "m"), ("status", "succeeded")))] == 5
    assert got[("kiln_items_total", (("model", "m"), ("status", "failed")))] == 1
    for stage in STAGES:
        assert got[("kiln_stage_seconds_total", (("model", "m"), ("stage", stage)))] == 0.5
    assert got[("kiln_batch_out_of_memory_total", (("model", "m"),))] == 0
