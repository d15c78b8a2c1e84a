"""What a worker publishes for the fleet page: its models' backend, owner and batching, its
problems and its GPU's NVML sample (absent figures stay absent), written and withdrawn."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import select

from kiln.app.core.config import Settings
from kiln.app.db.models import SHARED_TENANT, WorkerFacts
from kiln.app.db.session import make_engine, make_session_factory
from kiln.workers.batching import BatchStats
from kiln.workers.ops import device
from kiln.workers.ops.chunk_stats import ChunkTotals
from kiln.workers.ops.device import GpuTelemetry
from kiln.workers.ops.facts import FactsPublisher, worker_facts
from kiln.workers.ops.health import EngineHealth
from tests.workers.test_device import BOARDS, fake_nvml


class View:
    """A worker with a built-in model that ran two batches and a tenant's model still idle."""

    def __init__(self, problems: list[str] | None = None) -> None:
        self.problems = problems or []

    def batch_stats(self) -> dict[str, BatchStats]:
        return {"ocr": BatchStats(batches=2, rows=24, failed_batches=1, engine_seconds=0.5,
                                  size_counts=Counter({16: 1, 8: 1}))}  # fmt: skip

    def backends(self) -> dict[str, str]:
        return {"ocr": "onnxruntime:CPUExecutionProvider", "mine:3": "tensorrt"}

    def chunk_totals(self) -> dict[str, ChunkTotals]:
        return {}

    def engine_health(self) -> EngineHealth:
        return EngineHealth(problems=self.problems)

    def model_owners(self) -> dict[str, str]:
        return {"ocr": SHARED_TENANT, "mine:3": "acme"}


@pytest.fixture
def telemetry(monkeypatch: pytest.MonkeyPatch) -> GpuTelemetry:
    monkeypatch.setattr(device, "nvml", lambda: fake_nvml(BOARDS))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return GpuTelemetry()


def test_models_carry_backend_owner_and_batching() -> None:
    models = worker_facts(View(), None)["models"]
    assert models["ocr"] == {
        "backend": "onnxruntime:CPUExecutionProvider",
        "tenant": SHARED_TENANT,
        "batches": 2,
        "rows": 24,
        "mean_batch": 12.0,
        "engine_ms_per_batch": 250.0,
        "failed_batches": 1,
    }
    assert models["mine:3"] == {"backend": "tensorrt", "tenant": "acme"}  # loaded, no batch yet


def test_a_cpu_worker_has_no_gpu_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "nvml", lambda: None)
    assert "gpu" not in worker_facts(View(), GpuTelemetry())


def test_the_gpu_sample_is_what_nvml_answered(
    telemetry: GpuTelemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    sample = worker_facts(View(), telemetry)["gpu"]
    assert sample == {
        "name": "NVIDIA A10G",
        "index": 0,
        "utilization_pct": 87.0,
        "memory_used_bytes": 2**30,
        "memory_total_bytes": 24 * 2**30,
        "temperature_c": 61.0,
        "power_w": 70.0,
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # pinned to the board without power
    sample = worker_facts(View(), GpuTelemetry())["gpu"]
    assert sample["name"] == "NVIDIA L4" and "power_w" not in sample  # absent, never 0


def _rows(settings: Settings) -> list[WorkerFacts]:
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            return list(session.scalars(select(WorkerFacts)))
    finally:
        engine.dispose()


def test_published_while_running_and_withdrawn_on_stop(
    settings: Settings, telemetry: GpuTelemetry
) -> None:
    engine = make_engine(settings.database_url)
    publisher = FactsPublisher(engine, "gpu0@host", View(["engine stuck"]), telemetry, 0.05)
    publisher.start()
    try:
        assert publisher.publish()
        [row] = _rows(settings)
        assert (row.worker, row.device) == ("gpu0@host", "NVIDIA A10G")
        assert row.facts["problems"] == ["engine stuck"]
        assert row.facts["gpu"]["utilization_pct"] == 87.0
        first_seen = row.seen_at
        assert publisher.publish()
        [again] = _rows(settings)  # one row per worker, refreshed in place
        assert again.seen_at >= first_seen and again.started_at == row.started_at
    finally:
        publisher.stop()
    assert _rows(settings) == []


def test_a_database_outage_is_said_once_and_never_raises(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(f"sqlite:///{tmp_path}/missing-dir/none.db")  # cannot be opened
    publisher = FactsPublisher(engine, "cpu@host", View(), None, 60)
    with caplog.at_level(logging.WARNING, logger="kiln.workers.ops.facts"):
        assert not publisher.publish()
        assert not publisher.publish()
    assert len([r for r in caplog.records if "facts" in r.getMessage()]) == 1
    publisher.stop()  # never started: stops cleanly all the same


def test_memory_is_published_per_process_and_per_model() -> None:
    class Holding(View):
        def engine_health(self) -> EngineHealth:
            return EngineHealth(rss_bytes=2500 * 2**20, prep_rss_bytes=600 * 2**20,
                                memory={"ocr": 300 * 2**20}, slot_memory={"ocr": 0})  # fmt: skip

    facts = worker_facts(Holding(), None)
    assert facts["memory"] == {"rss_bytes": 2500 * 2**20, "prep_rss_bytes": 600 * 2**20}
    assert facts["models"]["ocr"]["memory_bytes"] == 300 * 2**20
    assert facts["models"]["ocr"]["slot_bytes"] == 0  # rows as objects: no slots
    assert "memory_bytes" not in facts["models"]["mine:3"]  # not known: absent, never 0
    assert worker_facts(View(), None)["memory"] == {}  # RSS unread (not Linux): absent


def test_capacity_is_published_when_given() -> None:
    facts = worker_facts(View(), None, {"cores": 8, "prep_processes": 8})
    assert facts["capacity"] == {"cores": 8, "prep_processes": 8}  # the estimate reads it
    assert "capacity" not in worker_facts(View(), None)  # not known: absent
