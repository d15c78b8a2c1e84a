"""The TensorRT engine on a real NVIDIA GPU: outputs against ONNX Runtime (FP32 and FP16), the
device-side `prepare`, concurrent runners, the plan cache round trip and a corrupted plan.

Skipped, with the reason, where no GPU, TensorRT or CuPy is present; with KILN_REQUIRE_GPU=1
(a GPU CI runner) a missing piece is an error instead, so that run can never pass by skipping.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.app.core.config import Settings, get_settings
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.base import Choice, EngineRequest, prepared
from kiln.workers.engines.engine_cache import timing_cache_key
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.tensorrt import TensorRTEngine, build_tensorrt_engine, prebuild
from kiln.workers.engines.tensorrt_logic import EngineBuildError
from kiln.workers.ops.device import Gpu, list_gpus
from kiln.workers.prep.pixels import normalize

MAX_BATCH = 8
# (rtol, atol): FP16 rounds activations and weights to ~3 significant digits.
TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (1e-2, 5e-2)}


def _missing() -> str | None:
    """Why these tests cannot run here, or None."""
    reasons = []
    if not list_gpus():
        reasons.append("no NVIDIA GPU visible (NVML)")
    try:
        import tensorrt

        if not hasattr(tensorrt, "Builder"):
            reasons.append("tensorrt not installed (only its type stubs)")
    except ImportError:
        reasons.append("tensorrt not installed")
    if importlib.util.find_spec("cupy") is None:
        reasons.append("cupy not installed")
    return "; ".join(reasons) or None


MISSING = _missing()
if MISSING and os.environ.get("KILN_REQUIRE_GPU") == "1":
    raise RuntimeError(f"KILN_REQUIRE_GPU=1, but {MISSING}.")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(MISSING is not None, reason=f"{MISSING} (set KILN_REQUIRE_GPU=1 to fail)"),
]


def small_cnn(path: Path) -> Path:
    """Conv 3→8 → ReLU → global pool → Gemm 8→5 over a dynamic batch of 3×32×32 images:
    small, but real convolution and GEMM kernels for TensorRT to choose and FP16 to round."""
    rng = np.random.default_rng(7)
    conv = rng.normal(0, 0.3, (8, 3, 3, 3)).astype(np.float32)
    dense = rng.normal(0, 0.5, (5, 8)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["images", "C", "CB"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["relu"]),
            helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "W", "B"], ["logits"], transB=1),
        ],
        "small_cnn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5])],
        [
            numpy_helper.from_array(conv, "C"),
            numpy_helper.from_array(np.full(8, 0.1, np.float32), "CB"),
            numpy_helper.from_array(dense, "W"),
            numpy_helper.from_array(np.zeros(5, np.float32), "B"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return small_cnn(tmp_path / "small_cnn.onnx")


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


@pytest.fixture
def gpu() -> Gpu:
    return list_gpus()[0]


@pytest.fixture
def settings_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in list(os.environ):
        if name.upper().startswith("KILN_"):
            monkeypatch.delenv(name)

    def make(precision: str = "fp32") -> Settings:
        return get_settings(data_dir=tmp_path / "data", precision=precision)

    return make


def engine_for(
    model: Path, settings: Settings, store: LocalStore, gpu: Gpu, runners: int = 2
) -> TensorRTEngine:
    request = EngineRequest("small-cnn", model, MAX_BATCH)
    return build_tensorrt_engine(
        request, settings, store, gpu, runners, Choice("tensorrt", "gpu test")
    )


def reference(model: Path) -> OnnxRuntimeEngine:
    return OnnxRuntimeEngine(model, max_batch=MAX_BATCH)


def assert_close(got: np.ndarray, want: np.ndarray, precision: str = "fp32") -> None:
    rtol, atol = TOLERANCE[precision]
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def images(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_outputs_match_onnxruntime(model, store, gpu, settings_for, precision) -> None:
    engine = engine_for(model, settings_for(precision), store, gpu)
    assert engine.backend == f"tensorrt:{precision}"
    assert engine.reason == "gpu test"
    assert engine.max_batch == MAX_BATCH
    assert [(s.name, s.shape, s.dtype) for s in engine.inputs] == [
        ("images", (None, 3, 32, 32), "float32")
    ]
    ort = reference(model)
    for batch in (1, 3, MAX_BATCH):
        x = images(batch, seed=batch)
        got = engine.infer({"images": x})["logits"]
        want = ort.infer({"images": x})["logits"]
        assert got.shape == (batch, 5) and got.dtype == np.float32
        assert_close(got, want, precision)


def test_prepare_runs_on_the_device(model, store, gpu, settings_for) -> None:
    engine = engine_for(model, settings_for("fp32"), store, gpu)
    seen: list[str] = []

    def prepare(xp: ModuleType, batch: Any) -> Any:
        seen.append(xp.__name__)
        return normalize(xp, batch, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))

    pixels = np.random.default_rng(1).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    got = engine.infer({"images": pixels}, {"images": prepare})["logits"]
    want = reference(model).infer(prepared({"images": pixels}, {"images": prepare}))["logits"]
    assert seen[0] == "cupy"
    assert_close(got, want)


def test_runner_threads_share_the_contexts(model, store, gpu, settings_for) -> None:
    engine = engine_for(model, settings_for("fp32"), store, gpu, runners=2)
    ort = reference(model)
    failures: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            for step in range(5):
                x = images(1 + (seed + step) % MAX_BATCH, seed=seed * 10 + step)
                got = engine.infer({"images": x})["logits"]
                assert_close(got, ort.infer({"images": x})["logits"])
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures


def test_bad_feeds_fail_the_call_not_the_engine(model, store, gpu, settings_for) -> None:
    engine = engine_for(model, settings_for("fp32"), store, gpu, runners=1)
    with pytest.raises(ValueError, match="shape"):
        engine.infer({"images": images(MAX_BATCH + 1)})
    with pytest.raises(ValueError, match="float64"):
        engine.infer({"images": images(2).astype(np.float64)})
    with pytest.raises(ValueError, match="takes inputs"):
        engine.infer({"pixels": images(2)})
    # The single context came back each time.
    assert engine.infer({"images": images(2)})["logits"].shape == (2, 5)


def test_second_build_loads_the_cached_plan(model, store, gpu, settings_for) -> None:
    first = engine_for(model, settings_for("fp32"), store, gpu)
    assert first.plan_source == "built"
    import tensorrt

    assert store.exists(timing_cache_key(tensorrt.__version__, gpu.slug))
    second = engine_for(model, settings_for("fp32"), store, gpu)
    assert second.plan_source == "cache"
    x = images(4)
    np.testing.assert_array_equal(
        first.infer({"images": x})["logits"], second.infer({"images": x})["logits"]
    )
    # Another precision is another plan.
    assert engine_for(model, settings_for("fp16"), store, gpu).plan_source == "built"


def test_prebuild_uploads_a_plan_that_workers_load(model, store, gpu, settings_for) -> None:
    request = EngineRequest("small-cnn", model, MAX_BATCH)
    key = prebuild(request, settings_for("fp32"), store, gpu)
    assert store.exists(key) and key.endswith(".plan")
    assert prebuild(request, settings_for("fp32"), store, gpu) == key  # cached: no rebuild
    assert engine_for(model, settings_for("fp32"), store, gpu).plan_source == "cache"


@pytest.mark.parametrize("fix_checksum", [False, True], ids=["bytes", "deserialize"])
def test_a_corrupted_plan_is_rebuilt(model, store, gpu, settings_for, fix_checksum) -> None:
    request = EngineRequest("small-cnn", model, MAX_BATCH)
    key = prebuild(request, settings_for("fp32"), store, gpu)
    junk = b"not a TensorRT plan" * 100
    store.put(key, junk)
    if fix_checksum:  # get past the checksum, so TensorRT's deserializer itself sees the junk
        manifest_key = key.removesuffix(".plan") + ".json"
        manifest = json.loads(store.get(manifest_key))
        manifest["plan_sha256"] = hashlib.sha256(junk).hexdigest()
        store.put(manifest_key, json.dumps(manifest).encode())
    engine = engine_for(model, settings_for("fp32"), store, gpu)
    assert engine.plan_source == "built"
    assert store.get(key) != junk
    x = images(3)
    assert_close(
        engine.infer({"images": x})["logits"], reference(model).infer({"images": x})["logits"]
    )


def test_parser_errors_are_reported(tmp_path, store, gpu, settings_for) -> None:
    graph = helper.make_graph(
        [helper.make_node("KilnNoSuchOp", ["x"], ["y"])],
        "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)  # not checked: the operator is unknown on purpose
    request = EngineRequest("bad", path, MAX_BATCH)
    with pytest.raises(EngineBuildError, match=r"could not parse bad\.onnx") as error:
        prebuild(request, settings_for("fp32"), store, gpu)
    assert "KilnNoSuchOp" in str(error.value)
