"""The TensorRT engine's pure parts, on a CPU: profiles from ONNX shapes, buffer sizes, dtypes,
precision, plan keys, the context pool, and that the module imports without TensorRT or CuPy."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.engine_cache import plan_spec
from kiln.workers.engines.tensorrt import IoTensor, spec_of
from kiln.workers.engines.tensorrt_logic import (
    ContextPool,
    EngineBuildError,
    InputShape,
    TensorRange,
    batch_profile,
    buffer_bytes,
    check_feed,
    check_names,
    concrete_shape,
    decide_precision,
    engine_max_batch,
    grown,
    numpy_dtype,
    onnx_input_shapes,
    opt_batch,
    parse_failure,
    python_level,
    volume,
)
from kiln.workers.ops.device import Gpu

F32 = np.dtype(np.float32)
A10G = Gpu(0, "NVIDIA A10G", "GPU-0", (8, 6), 24 << 30)


def save_model(
    path: Path,
    inputs: list[onnx.ValueInfoProto],
    *,
    weights_as_inputs: bool = False,
    check: bool = True,
) -> Path:
    """A real ONNX graph (Identity per input, plus one initializer) with the given inputs."""
    weight = numpy_helper.from_array(np.ones(2, np.float32), "W")
    listed = [*inputs, helper.make_tensor_value_info("W", TensorProto.FLOAT, [2])]
    outputs = [onnx.ValueInfoProto() for _ in inputs]
    for output, value in zip(outputs, inputs, strict=True):
        output.CopyFrom(value)
        output.name = f"{value.name}_out"
    graph = helper.make_graph(
        [helper.make_node("Identity", [i.name], [f"{i.name}_out"]) for i in inputs],
        "shapes",
        listed if weights_as_inputs else inputs,
        outputs,
        [weight],
    )
    # onnx >= 1.23 writes IR 14 by default, which onnxruntime refuses.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    if check:
        onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def image_input(name: str = "images", batch: int | str = "N") -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [batch, 3, 224, 224])


# --- precision and types ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "fast", "expected"),
    [
        ("auto", True, "fp16"),
        ("auto", False, "fp32"),
        ("fp16", False, "fp16"),  # asked for: TensorRT still builds, just not faster
        ("fp32", True, "fp32"),
    ],
)
def test_precision_decision(setting, fast, expected) -> None:
    assert decide_precision(setting, fast) == expected


@pytest.mark.parametrize(
    ("trt_name", "dtype"),
    [
        ("FLOAT", np.float32),
        ("HALF", np.float16),
        ("INT8", np.int8),
        ("UINT8", np.uint8),
        ("INT32", np.int32),
        ("INT64", np.int64),
        ("BOOL", np.bool_),
    ],
)
def test_tensorrt_dtypes_map_to_numpy(trt_name: str, dtype: type) -> None:
    assert numpy_dtype(trt_name) == np.dtype(dtype)


@pytest.mark.parametrize("trt_name", ["BF16", "FP8", "INT4", "FP4", "E8M0"])
def test_tensorrt_dtypes_without_numpy_twin_are_refused(trt_name: str) -> None:
    with pytest.raises(EngineBuildError, match=trt_name):
        numpy_dtype(trt_name)


def test_tensorrt_severities_map_to_logging_levels() -> None:
    levels = [python_level(s) for s in range(5)]
    assert levels == [logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]
    assert python_level(99) == logging.DEBUG


def test_parser_failure_names_the_file_and_every_message() -> None:
    message = parse_failure(Path("/m/model.onnx"), ["No importer for op: Foo ", "", "node 3 bad"])
    assert message == "TensorRT could not parse model.onnx: No importer for op: Foo; node 3 bad."
    assert "no message" in parse_failure(Path("m.onnx"), [])


# --- profiles from ONNX shapes ------------------------------------------------------------


def test_onnx_input_shapes_mark_dynamic_dims(tmp_path: Path) -> None:
    path = save_model(tmp_path / "m.onnx", [image_input(), image_input("mask", 1)])
    assert onnx_input_shapes(path) == [
        InputShape("images", (None, 3, 224, 224)),
        InputShape("mask", (1, 3, 224, 224)),
    ]


def test_onnx_initializers_listed_as_inputs_are_not_inputs(tmp_path: Path) -> None:
    path = save_model(tmp_path / "m.onnx", [image_input()], weights_as_inputs=True)
    assert [s.name for s in onnx_input_shapes(path)] == ["images"]


def test_onnx_input_without_rank_is_refused(tmp_path: Path) -> None:
    unranked = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    path = save_model(tmp_path / "m.onnx", [unranked], check=False)
    with pytest.raises(EngineBuildError, match="no declared rank"):
        onnx_input_shapes(path)


def test_profile_spans_one_to_max_batch_with_opt_at_max(tmp_path: Path) -> None:
    path = save_model(tmp_path / "m.onnx", [image_input()])
    (images,) = batch_profile(onnx_input_shapes(path), 16)
    assert images == TensorRange("images", (1, 3, 224, 224), (16, 3, 224, 224), (16, 3, 224, 224))
    assert images.dynamic
    assert opt_batch(16) == 16


def test_profile_keeps_fixed_inputs_fixed_and_sorts_by_name() -> None:
    shapes = [InputShape("z", (None, 4)), InputShape("a", (2, 4)), InputShape("s", ())]
    profile = batch_profile(shapes, 8)
    assert [r.name for r in profile] == ["a", "s", "z"]
    assert profile[0] == TensorRange.fixed("a", (2, 4))
    assert not profile[0].dynamic
    assert profile[1] == TensorRange.fixed("s", ())
    assert profile[2] == TensorRange("z", (1, 4), (8, 4), (8, 4))


def test_profile_refuses_dynamic_dims_besides_the_batch() -> None:
    with pytest.raises(EngineBuildError, match=r"'images' has dynamic dimension\(s\) \[2, 3\]"):
        batch_profile([InputShape("images", (None, 3, None, None))], 8)


def test_profile_needs_inputs_and_a_positive_batch() -> None:
    with pytest.raises(EngineBuildError, match="no inputs"):
        batch_profile([], 8)
    with pytest.raises(ValueError, match="at least 1"):
        batch_profile([InputShape("x", (None, 3))], 0)


def test_engine_max_batch() -> None:
    dynamic = TensorRange("x", (1, 3), (16, 3), (16, 3))
    assert engine_max_batch([dynamic], 16) == 16
    assert engine_max_batch([dynamic], 4) == 4
    # A model exported with a fixed batch runs exactly that batch.
    assert engine_max_batch([TensorRange.fixed("x", (1, 3))], 16) == 1
    assert engine_max_batch([TensorRange.fixed("s", ())], 16) == 1


# --- feeds --------------------------------------------------------------------------------


def test_check_feed_accepts_batches_within_the_profile() -> None:
    spec = TensorRange("x", (1, 3, 4), (8, 3, 4), (8, 3, 4))
    for batch in (1, 5, 8):
        check_feed(spec, (batch, 3, 4), F32, F32)


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((9, 3, 4), F32, r"shape \(9, 3, 4\); the engine takes \(1, 3, 4\) to \(8, 3, 4\)"),
        ((0, 3, 4), F32, "shape"),
        ((2, 4, 3), F32, "shape"),
        ((2, 3), F32, "shape"),
        ((2, 3, 4), np.dtype(np.float64), "is float64, but the engine takes float32"),
    ],
)
def test_check_feed_refuses_what_the_engine_cannot_take(shape, dtype, match) -> None:
    spec = TensorRange("x", (1, 3, 4), (8, 3, 4), (8, 3, 4))
    with pytest.raises(ValueError, match=match):
        check_feed(spec, shape, dtype, F32)


def test_check_names() -> None:
    check_names(["a", "b"], {"b": 1, "a": 2})
    with pytest.raises(ValueError, match=r"takes inputs \['a', 'b'\], but was given \['a'\]"):
        check_names(["a", "b"], ["a"])


# --- buffers ------------------------------------------------------------------------------


def test_buffer_bytes_for_max_batch(tmp_path: Path) -> None:
    path = save_model(tmp_path / "m.onnx", [image_input()])
    (images,) = batch_profile(onnx_input_shapes(path), 16)
    assert buffer_bytes(images.max, F32.itemsize) == 16 * 3 * 224 * 224 * 4 == 9_633_792
    assert buffer_bytes(images.max, np.dtype(np.float16).itemsize) == 4_816_896
    # The uint8 NHWC pixels a predictor feeds before `prepare` fit in the float32 staging.
    assert buffer_bytes((16, 224, 224, 3), 1) < buffer_bytes(images.max, F32.itemsize)


def test_volume_of_a_scalar_and_of_an_unresolved_shape() -> None:
    assert volume(()) == 1
    with pytest.raises(ValueError, match="not concrete"):
        volume((-1, 3))


def test_staging_grows_at_least_twofold_and_only_when_needed() -> None:
    assert grown(100, 80) == 100
    assert grown(100, 100) == 100
    assert grown(100, 150) == 200
    assert grown(100, 500) == 500
    assert grown(0, 1) == 1


def test_data_dependent_output_shapes_are_refused() -> None:
    assert concrete_shape("boxes", (8, 4)) == (8, 4)
    with pytest.raises(EngineBuildError, match="data-dependent"):
        concrete_shape("boxes", (-1, 4))


def test_tensor_specs_show_dynamic_dims_as_none() -> None:
    tensor = IoTensor("images", True, F32, (-1, 3, 224, 224), None)
    spec = spec_of(tensor)
    assert spec.shape == (None, 3, 224, 224)
    assert spec.dtype == "float32"


# --- plan spec (the cache key's parts) ----------------------------------------------------


def test_plan_spec_composes_the_key_from_file_profile_gpu_and_precision(tmp_path: Path) -> None:
    path = save_model(tmp_path / "m.onnx", [image_input()])
    request = EngineRequest("resnet", path, 8)

    def no_builder() -> bool:
        raise AssertionError("only `auto` asks the builder")

    spec = plan_spec(request, A10G, "fp32", tensorrt_version="10.13.0.35", fast_fp16=no_builder)
    assert spec.precision == "fp32"
    assert spec.key.gpu == "nvidia-a10g-sm86"
    assert spec.key.tensorrt_version == "10.13.0.35"
    assert spec.key.profile == spec.profile == batch_profile(onnx_input_shapes(path), 8)
    auto = plan_spec(request, A10G, "auto", tensorrt_version="10.13.0.35", fast_fp16=lambda: True)
    assert auto.precision == "fp16"
    assert auto.key.onnx_sha256 == spec.key.onnx_sha256
    assert auto.key.plan_key != spec.key.plan_key


# --- context pool -------------------------------------------------------------------------


def test_context_pool_never_lends_more_than_it_has() -> None:
    pool = ContextPool(["a", "b"])
    lock = threading.Lock()
    in_use: set[str] = set()
    peak = 0

    def work() -> None:
        nonlocal peak
        for _ in range(5):
            with pool.take() as context:
                with lock:
                    assert context not in in_use  # one batch per context at a time
                    in_use.add(context)
                    peak = max(peak, len(in_use))
                time.sleep(0.002)
                with lock:
                    in_use.discard(context)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert 1 <= peak <= 2
    assert pool.free() == 2


def test_a_context_comes_back_when_the_work_raises() -> None:
    pool = ContextPool(["only"])
    with pytest.raises(RuntimeError, match="kernel failed"), pool.take():
        raise RuntimeError("kernel failed")
    assert pool.free() == 1
    with pool.take() as context:
        assert context == "only"


def test_a_caller_waits_for_a_free_context() -> None:
    pool = ContextPool(["only"])
    got = threading.Event()

    def waiter() -> None:
        with pool.take():
            got.set()

    with pool.take():
        thread = threading.Thread(target=waiter)
        thread.start()
        assert not got.wait(0.05)  # the only context is busy
    assert got.wait(5)
    thread.join(timeout=5)


def test_context_pool_needs_a_context() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ContextPool([])


# --- importing without TensorRT -----------------------------------------------------------


def test_module_imports_without_tensorrt_or_cupy() -> None:
    code = (
        "import sys, kiln.workers.engines.tensorrt, kiln.workers.engines.engine_cache; "
        "loaded = [m for m in ('tensorrt', 'cupy') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _real_tensorrt() -> bool:
    if importlib.util.find_spec("tensorrt") is None:
        return False
    import tensorrt

    return hasattr(tensorrt, "Builder")


@pytest.mark.skipif(_real_tensorrt(), reason="TensorRT is installed: this checks its absence")
def test_building_without_tensorrt_says_so(tmp_path: Path) -> None:
    from kiln.app.core.config import get_settings
    from kiln.app.storage.local import LocalStore
    from kiln.workers.engines.base import BackendUnavailableError, Choice
    from kiln.workers.engines.tensorrt import build_tensorrt_engine, prebuild

    request = EngineRequest("m", save_model(tmp_path / "m.onnx", [image_input()]), 4)
    settings = get_settings(data_dir=tmp_path)
    store = LocalStore(tmp_path / "objects")
    with pytest.raises(BackendUnavailableError, match="tensorrt"):
        prebuild(request, settings, store, A10G)
    with pytest.raises(BackendUnavailableError, match="tensorrt"):
        build_tensorrt_engine(request, settings, store, A10G, 2, Choice("tensorrt", "test"))


def test_a_declared_sequence_axis_gets_its_range() -> None:
    """Text models: batch and sequence length both vary; the profile spans both."""
    shapes = [InputShape("input_ids", (None, None)), InputShape("attention_mask", (None, None))]
    profile = batch_profile(shapes, 16, axes=((1, 1, 128, 256),))
    assert [(r.name, r.min, r.opt, r.max) for r in profile] == [
        ("attention_mask", (1, 1), (16, 128), (16, 256)),
        ("input_ids", (1, 1), (16, 128), (16, 256)),
    ]
    with pytest.raises(EngineBuildError, match="no range for them"):
        batch_profile(shapes, 16)
