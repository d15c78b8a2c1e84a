"""Per-model backend choice: each model gets the best backend that builds it, a failed build is
remembered (and retried with backoff, not on every chunk), and the reason is kept."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from kiln.app.core.config import Settings
from kiln.app.core.errors import TransientError
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.base import Choice, EngineRequest, Prepare, TensorSpec
from kiln.workers.engines.failures import MAX_WAIT_S, BuildFailures
from kiln.workers.engines.select import EngineFactory, Host, candidates
from kiln.workers.engines.tensorrt_logic import EngineBuildError
from kiln.workers.ops.device import Gpu

H100 = Gpu(0, "NVIDIA H100", "GPU-h", (9, 0), 80 * 2**30)
GPU_HOST = Host(
    tensorrt=True,
    gpus=(H100,),
    ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
    cpus=16,
    torch_cuda=True,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    def __init__(self, backend: str, reason: str, max_batch: int) -> None:
        self.backend, self.reason, self.max_batch = backend, reason, max_batch
        self.inputs = [TensorSpec("x", (None, 3), "float32")]
        self.outputs = [TensorSpec("y", (None, 3), "float32")]

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        return {"y": feeds["x"]}


class Builders:
    """Fake backends: `broken` maps a backend to the models it cannot build."""

    def __init__(self, broken: dict[str, set[str]]) -> None:
        self.broken = broken
        self.calls: Counter[tuple[str, str]] = Counter()

    def table(self) -> dict[str, object]:
        return {backend: self._builder(backend) for backend in
                ("tensorrt", "onnxruntime-cuda", "torch-cuda", "onnxruntime-cpu")}  # fmt: skip

    def _builder(self, backend: str) -> object:
        def build(request: EngineRequest, choice: Choice) -> FakeEngine:
            self.calls[(request.name, backend)] += 1
            if request.name in self.broken.get(backend, set()):
                raise EngineBuildError(f"{backend} cannot build {request.name}: op NonZero")
            return FakeEngine(backend, choice.reason, request.max_batch)

        return build


def factory(
    tmp_path: Path, builders: Builders, clock: Clock, host: Host = GPU_HOST
) -> EngineFactory:
    settings = Settings(data_dir=tmp_path, engine_retry_s=60)
    return EngineFactory(
        settings,
        LocalStore(tmp_path / "store"),
        host=host,
        builders=builders.table(),  # type: ignore[arg-type]
        failures=BuildFailures(60, clock=clock),
    )


def test_auto_ranks_every_backend_the_host_can_run() -> None:
    assert [c.backend for c in candidates(GPU_HOST)] == [
        "tensorrt",
        "onnxruntime-cuda",
        "torch-cuda",
        "onnxruntime-cpu",
    ]
    assert [c.backend for c in candidates(GPU_HOST, "torch-cuda")] == ["torch-cuda"]
    cpu_only = Host(tensorrt=False, gpus=(), ort_providers=("CPUExecutionProvider",), cpus=2)
    [only] = candidates(cpu_only)
    assert (only.backend, only.reason) == ("onnxruntime-cpu", "no GPU is visible")


def test_a_model_tensorrt_cannot_build_falls_back_and_others_keep_tensorrt(
    tmp_path: Path,
) -> None:
    builders = Builders({"tensorrt": {"yolo:1"}})
    engines = factory(tmp_path, builders, Clock())
    yolo = engines.build("yolo:1", tmp_path / "yolo.onnx", 8)
    resnet = engines.build("resnet:1", tmp_path / "resnet.onnx", 8)
    assert (yolo.backend, resnet.backend) == ("onnxruntime-cuda", "tensorrt")
    assert "fell back: tensorrt failed (tensorrt cannot build yolo:1: op NonZero)" in yolo.reason
    assert "fell back" not in resnet.reason
    assert [b.name for b in engines.built] == ["yolo:1", "resnet:1"]


def test_a_failed_build_is_remembered_and_retried_with_backoff(tmp_path: Path) -> None:
    builders = Builders({"tensorrt": {"yolo:1"}})
    clock = Clock()
    engines = factory(tmp_path, builders, clock)
    for _ in range(3):  # three chunks: one TensorRT attempt
        engine = engines.build("yolo:1", tmp_path / "yolo.onnx", 8)
    assert builders.calls[("yolo:1", "tensorrt")] == 1
    assert "next try in 60 s" in engine.reason
    clock.now += 61  # the backoff has passed: tried again, fails again, waits twice as long
    engines.build("yolo:1", tmp_path / "yolo.onnx", 8)
    assert builders.calls[("yolo:1", "tensorrt")] == 2
    [failure] = engines.failures.snapshot().values()
    assert failure.attempts == 2 and failure.retry_at == pytest.approx(clock.now + 120)
    builders.broken = {}  # fixed (a new TensorRT): after the backoff it wins again
    clock.now += 121
    assert engines.build("yolo:1", tmp_path / "yolo.onnx", 8).backend == "tensorrt"
    assert engines.failures.snapshot() == {}


def test_no_backend_builds_it_says_every_reason(tmp_path: Path) -> None:
    every = {"yolo:1"}
    builders = Builders({b: every for b in ("tensorrt", "onnxruntime-cuda", "torch-cuda")})
    builders.broken["onnxruntime-cpu"] = every
    with pytest.raises(EngineBuildError) as raised:
        factory(tmp_path, builders, Clock()).build("yolo:1", tmp_path / "yolo.onnx", 8)
    message = str(raised.value)
    assert message.startswith("No engine backend could build yolo:1: tensorrt failed")
    for backend in ("onnxruntime-cuda", "torch-cuda", "onnxruntime-cpu"):
        assert f"{backend} failed ({backend} cannot build yolo:1: op NonZero)" in message


def test_a_transient_fault_is_not_held_against_the_backend(tmp_path: Path) -> None:
    engines = factory(tmp_path, Builders({}), Clock())

    def flaky(request: EngineRequest, choice: Choice) -> FakeEngine:
        raise TransientError("The engine cache is unreachable.")

    engines.builders = {**engines.builders, "tensorrt": flaky}
    with pytest.raises(TransientError):
        engines.build("resnet:1", tmp_path / "resnet.onnx", 8)
    assert engines.failures.snapshot() == {}


def test_scoped_views_record_their_own_builds_and_share_failures(tmp_path: Path) -> None:
    builders = Builders({"tensorrt": {"yolo:1"}})
    engines = factory(tmp_path, builders, Clock())
    one, two = engines.scoped(), engines.scoped()
    one.build("yolo:1", tmp_path / "yolo.onnx", 8)
    two.build("yolo:1", tmp_path / "yolo.onnx", 8)
    assert [b.name for b in one.built] == [b.name for b in two.built] == ["yolo:1"]
    assert engines.built == []
    assert builders.calls[("yolo:1", "tensorrt")] == 1  # the second view knew


def test_backoff_doubles_up_to_a_day() -> None:
    clock = Clock()
    failures = BuildFailures(600, clock=clock)
    waits = []
    for _ in range(10):
        failure = failures.record("m", "tensorrt", "no")
        waits.append(failure.retry_at - clock.now)
    assert waits[:4] == [600, 1200, 2400, 4800]
    assert waits[-1] == MAX_WAIT_S
    assert failures.waiting("m", "tensorrt") is not None
    clock.now += MAX_WAIT_S + 1
    assert failures.waiting("m", "tensorrt") is None
