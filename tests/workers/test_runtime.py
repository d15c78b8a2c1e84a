"""The worker runtime's model loading: builds isolated per model, load failures remembered,
loaded models bounded by the memory budget. Predictors are fakes with declared sizes; the
database and store are real (SQLite, local)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db import queries
from kiln.workers.engines.base import Choice, EngineRequest, TensorSpec
from kiln.workers.engines.select import EngineFactory, Host
from kiln.workers.models.base import Answers, Batch, Rows
from kiln.workers.prep.spec import prep_spec
from kiln.workers.runners import runners as runners_module
from kiln.workers.runners.memory import MemoryBudgetFullError, ModelMemory
from kiln.workers.runners.runners import ModelUnavailableError
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings

CPU = Host(tensorrt=False, gpus=(), ort_providers=("CPUExecutionProvider",), cpus=2)
MiB = 2**20


class SizedEngine:
    def __init__(self, memory_bytes: int, reason: str) -> None:
        self.memory_bytes = memory_bytes
        self.backend, self.reason, self.max_batch = "onnxruntime:CPUExecutionProvider", reason, 4
        self.inputs: list[TensorSpec] = []
        self.outputs: list[TensorSpec] = []

    def infer(self, feeds: Any, prepare: Any = None) -> dict[str, np.ndarray]:
        raise AssertionError("not called: the fake predictor answers itself")


class FakePrep:
    """Rows as objects (no slots): the fake predictor answers without looking at them."""

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        return data


class FakePredictor:
    max_batch = 4
    max_runners = 1
    prep = prep_spec("tests.workers.test_runtime:FakePrep", {})

    def __init__(self, name: str, engines: EngineFactory) -> None:
        self.name = name
        self.engine = engines.build(name, Path(f"{name}.onnx"), 4)
        self.backend = self.engine.backend
        self.closed = False

    def infer(self, batch: Batch) -> Answers:
        return Answers(len(batch), {"model": pa.array([self.name] * len(batch))})

    def finish(self, answers: Answers) -> Answers:
        return answers

    def close(self) -> None:
        self.closed = True


def info(name: str) -> ModelInfo:
    return ModelInfo(name, "classify", "image", "", builtin=True, version="1")


class Loads:
    """The fake `load_predictor`: sizes per model, a gate that holds one model's build, and
    models that fail to load."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self.gates: dict[str, threading.Event] = {}
        self.broken: set[str] = set()
        self.calls: Counter[str] = Counter()
        self.building = threading.Event()

    def __call__(self, model: ModelInfo, engines: EngineFactory) -> FakePredictor:
        self.calls[model.name] += 1
        if model.name in self.broken:
            raise ValueError(f"{model.name}.onnx is not a valid model")
        gate = self.gates.get(model.name)
        if gate is not None:
            self.building.set()
            assert gate.wait(10)
        return FakePredictor(model.name, engines)

    def builder(self, request: EngineRequest, choice: Choice) -> SizedEngine:
        return SizedEngine(self.sizes.get(request.name, MiB), choice.reason)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> Loads:
    fake = Loads()
    monkeypatch.setattr(runners_module, "load_predictor", fake)
    return fake


@pytest.fixture
def runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads: Loads
) -> Iterator[WorkerRuntime]:
    settings = migrated_settings(tmp_path, monkeypatch, device_memory_budget="300MiB")
    runtime = WorkerRuntime(settings)
    factory = EngineFactory(settings, runtime.store, host=CPU, builders={
        "onnxruntime-cpu": loads.builder})  # type: ignore[dict-item]  # fmt: skip
    runtime.models._engines = factory
    try:
        yield runtime
    finally:
        runtime.close()


def test_a_slow_build_does_not_hold_other_models(runtime: WorkerRuntime, loads: Loads) -> None:
    loads.gates["slow"] = threading.Event()
    slow = threading.Thread(target=runtime.models.runner, args=(info("slow"),))
    slow.start()
    assert loads.building.wait(5)
    started = time.monotonic()
    fast = runtime.models.runner(info("fast"))  # loads while "slow" is still building
    blocks = [fast.batcher.submit(Rows(objects=[b"x"] * n)) for n in (1, 2)]
    answers = [block.result(timeout=5) for block in blocks]
    assert [a.columns["model"].to_pylist() for a in answers] == [["fast"], ["fast"] * 2]
    assert time.monotonic() - started < 2
    assert slow.is_alive()  # still building all along
    loads.gates["slow"].set()
    slow.join(5)
    assert runtime.models.runner(info("slow")).predictor.name == "slow"
    assert loads.calls == Counter({"slow": 1, "fast": 1})


def test_two_chunks_of_one_model_share_one_build(runtime: WorkerRuntime, loads: Loads) -> None:
    loads.gates["m"] = threading.Event()
    threads = [threading.Thread(target=runtime.models.runner, args=(info("m"),)) for _ in range(3)]
    for thread in threads:
        thread.start()
    assert loads.building.wait(5)
    loads.gates["m"].set()
    for thread in threads:
        thread.join(5)
    assert loads.calls["m"] == 1


def test_a_load_failure_is_remembered_and_reported(runtime: WorkerRuntime, loads: Loads) -> None:
    loads.broken.add("bad")
    with pytest.raises(ValueError, match="not a valid model"):
        runtime.models.runner(info("bad"))
    for _ in range(3):  # the next chunks fail fast with the reason, without a rebuild
        with pytest.raises(ModelUnavailableError, match=r"not a valid model \(next try in 600 s\)"):
            runtime.models.runner(info("bad"))
    assert loads.calls["bad"] == 1
    with runtime.sessions() as session:
        [report] = queries.engine_reports(session, ["bad"])
    assert report.backend == "none"
    assert report.reason.startswith("failed to load: bad.onnx is not a valid model (attempt 1")
    assert runtime.engine_health().build_failures == {("bad@1", "load"): 1}


def test_idle_models_are_unloaded_to_stay_within_the_budget(
    runtime: WorkerRuntime, loads: Loads
) -> None:
    loads.sizes = {"a": 200 * MiB, "b": 100 * MiB, "c": 150 * MiB}
    a = runtime.models.runner(info("a"))
    runtime.models.runner(info("b"))
    assert runtime.models.memory().used() == 300 * MiB
    runtime.models.runner(info("c"))  # 150 more: a (least recently used) goes
    assert set(runtime.models.runners()) == {"b@1", "c@1"}
    assert a.predictor.closed  # type: ignore[attr-defined]
    assert runtime.engine_health().unloaded == 1
    assert runtime.engine_health().memory == {"b": 100 * MiB, "c": 150 * MiB}
    with runtime.sessions() as session:
        [report] = queries.engine_reports(session, ["c"])
    assert report.device == "cpu"


def test_a_model_in_use_is_kept_and_a_newcomer_waits(runtime: WorkerRuntime, loads: Loads) -> None:
    loads.sizes = {"a": 200 * MiB, "b": 200 * MiB}
    with runtime.models.using(info("a")):
        runtime.models.runner(info("b"))  # over budget: a is in use, b loads beside it (warned)
        assert set(runtime.models.runners()) == {"a@1", "b@1"}
    runtime.models._unload(["b@1"])
    with (
        runtime.models.using(info("a")),
        runtime.models.using(info("b")),
        pytest.raises(MemoryBudgetFullError, match="the chunk will be retried"),
    ):
        runtime.models.runner(info("c"))  # over budget already, and nothing idle to unload


def test_unloading_skips_a_model_a_chunk_took_up_meanwhile(
    runtime: WorkerRuntime, loads: Loads
) -> None:
    runtime.models.runner(info("a"))
    with runtime.models.using(info("a")) as held:
        runtime.models._unload(["a@1"])  # chosen while idle, taken up since: it stays
        assert runtime.models.runners()["a@1"] is held
    runtime.models._unload(["a@1"])
    assert "a@1" not in runtime.models.runners()
    assert runtime.engine_health().unloaded == 1
    with runtime.models.using(info("a")) as again:  # loads it again
        assert again is not held and loads.calls["a"] == 2


def test_models_unused_for_the_idle_time_are_unloaded_and_one_in_use_stays(
    runtime: WorkerRuntime, loads: Loads, caplog: pytest.LogCaptureFixture
) -> None:
    clock = [0.0]
    runtime.models._memory = ModelMemory(300 * MiB, clock=lambda: clock[0])
    assert runtime.settings.model_idle_s == 600  # the default
    a, b = runtime.models.runner(info("a")), runtime.models.runner(info("b"))
    clock[0] = 599
    assert runtime.models.unload_idle() == []  # not yet
    with runtime.models.using(info("b")):
        clock[0] = 700
        with caplog.at_level(logging.INFO, logger="kiln.workers.runners.runners"):
            assert runtime.models.unload_idle() == ["a"]  # b is in use: it stays, however long
        assert set(runtime.models.runners()) == {"b@1"} and a.predictor.closed  # type: ignore[attr-defined]
    assert "model a unloaded after 600 s unused" in caplog.text
    clock[0] = 1299
    assert runtime.models.unload_idle() == []  # b's idle time began when the chunk let it go
    clock[0] = 1300
    assert runtime.models.unload_idle() == ["b"] and b.predictor.closed  # type: ignore[attr-defined]
    health = runtime.engine_health()
    assert (health.idle_unloaded, health.unloaded, health.memory) == (2, 0, {})
    with runtime.models.using(info("a")) as again:  # used again: loads again
        assert again is not a and loads.calls["a"] == 2


def test_a_zero_idle_time_keeps_models(runtime: WorkerRuntime, loads: Loads) -> None:
    runtime.models.settings = runtime.settings.model_copy(update={"model_idle_s": 0})
    runtime.models._memory = ModelMemory(300 * MiB, clock=lambda: 10.0**9)
    runtime.models.runner(info("a"))
    assert runtime.models.unload_idle() == [] and set(runtime.models.runners()) == {"a@1"}
    assert runtime.models._idle_watch is None  # no thread to look
