"""The uint8 input prepended to an ONNX graph computes what the NumPy normalisation computes,
keeps the input's name, is cached per model and normalisation, and is only used on the GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.app.core.config import Settings
from kiln.app.core.digest import file_sha256
from kiln.app.storage.local import LocalStore
from kiln.workers.engines import onnx_uint8, select
from kiln.workers.engines.base import Choice, EngineRequest
from kiln.workers.engines.onnx_uint8 import engine_onnx, prepend, prepended_path
from kiln.workers.engines.select import EngineFactory, Host
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.ops.device import Gpu

H, W = 6, 10
IMAGENET = Normalization(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
H100 = Gpu(0, "NVIDIA H100", "GPU-h", (9, 0), 80 * 2**30)


# --- models -------------------------------------------------------------------------------


def image_shape(layout: str, batch: int | str) -> list[int | str]:
    return [batch, 3, H, W] if layout == "NCHW" else [batch, H, W, 3]


def conv_model(
    layout: str = "NCHW", dtype: int = TensorProto.FLOAT, batch: int | str = "batch"
) -> onnx.ModelProto:
    """pixels → [Cast float32] → [Transpose NHWC→NCHW] → Conv 3→4, 3×3 → [Cast back] → y."""
    rng = np.random.default_rng(7)
    weights = [
        numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "b"),
    ]
    nodes, current = [], "pixels"
    if dtype == TensorProto.FLOAT16:  # ONNX Runtime's CPU Conv is float32 only
        nodes.append(helper.make_node("Cast", [current], ["x32"], to=TensorProto.FLOAT))
        current = "x32"
    if layout == "NHWC":
        nodes.append(helper.make_node("Transpose", [current], ["nchw"], perm=[0, 3, 1, 2]))
        current = "nchw"
    conv_out = "y" if dtype == TensorProto.FLOAT else "y32"
    nodes.append(helper.make_node("Conv", [current, "w", "b"], [conv_out], pads=[1, 1, 1, 1]))
    if dtype == TensorProto.FLOAT16:
        nodes.append(helper.make_node("Cast", ["y32"], ["y"], to=TensorProto.FLOAT16))
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("pixels", dtype, image_shape(layout, batch))],
        [helper.make_tensor_value_info("y", dtype, [batch, 4, H, W])],
        weights,
    )
    return make(graph)


def identity_model(layout: str, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """The normalised tensor itself as the output: the strictest comparison."""
    shape = image_shape(layout, "batch")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["pixels"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("pixels", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, shape)],
    )
    return make(graph)


def make(graph: onnx.GraphProto) -> onnx.ModelProto:
    # ONNX Runtime refuses the IR version onnx writes by default; 10 with opset 17 it takes.
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def pixels(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, H, W, 3), dtype=np.uint8)


def run_both(
    model: onnx.ModelProto, norm: Normalization, batch: np.ndarray, dtype: str = "float32"
) -> tuple[np.ndarray, np.ndarray]:
    """(the prepended model on uint8 pixels, the original on NumPy-normalised ones)."""
    fused = session(prepend(model, norm)).run(None, {"pixels": batch})[0]
    reference = session(model).run(None, {"pixels": norm(np, batch, dtype)})[0]
    return fused, reference


# --- the same numbers ---------------------------------------------------------------------

NORMS = {
    "NCHW RGB": IMAGENET,
    "NCHW BGR": Normalization((0.406, 0.456, 0.485), (0.225, 0.224, 0.229), channel_order="BGR"),
    "NHWC RGB": Normalization((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), layout="NHWC"),
    "NHWC BGR": Normalization((103.5, 116.3, 123.7), (1, 1, 1), 1.0, "BGR", "NHWC"),
}


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
def test_prepended_nodes_equal_the_numpy_normalisation(norm: Normalization) -> None:
    fused, reference = run_both(identity_model(norm.layout), norm, pixels(3))
    assert fused.dtype == np.float32
    np.testing.assert_allclose(fused, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", NORMS.values(), ids=NORMS.keys())
def test_a_conv_model_gives_the_same_outputs(norm: Normalization) -> None:
    fused, reference = run_both(conv_model(norm.layout), norm, pixels(2))
    np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_float16_input_is_cast_last(layout: str) -> None:
    norm = Normalization(IMAGENET.mean, IMAGENET.std, channel_order="BGR", layout=layout)
    half = "float16"
    exact, reference = run_both(identity_model(layout, TensorProto.FLOAT16), norm, pixels(2), half)
    assert exact.dtype == np.float16
    np.testing.assert_array_equal(exact, reference)  # float32 math, then one rounding
    fused, reference = run_both(conv_model(layout, TensorProto.FLOAT16), norm, pixels(2), half)
    assert fused.dtype == np.float16
    np.testing.assert_allclose(fused, reference, rtol=2e-3, atol=2e-2)


def test_a_dynamic_batch_stays_dynamic() -> None:
    uint8 = session(prepend(conv_model(), IMAGENET))
    for batch in (1, 5):
        fused = uint8.run(None, {"pixels": pixels(batch, seed=batch)})[0]
        reference = session(conv_model()).run(
            None, {"pixels": IMAGENET(np, pixels(batch, seed=batch))}
        )[0]
        assert fused.shape == (batch, 4, H, W)
        np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("batch", "declared"), [("batch", "batch"), (2, 2)])
def test_the_feed_keeps_its_name_and_becomes_uint8_nhwc(
    batch: int | str, declared: int | str
) -> None:
    model = conv_model(batch=batch)
    (feed,) = session(prepend(model, IMAGENET)).get_inputs()
    assert (feed.name, feed.type, feed.shape) == ("pixels", "tensor(uint8)", [declared, H, W, 3])
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT  # not mutated
    assert len(model.graph.node) == 1


def test_the_model_keeps_its_ir_version_and_opsets() -> None:
    model = conv_model()
    model.ir_version = 8
    fused = prepend(model, NORMS["NCHW BGR"])
    assert fused.ir_version == 8
    assert [(o.domain, o.version) for o in fused.opset_import] == [("", 17)]
    assert [n.op_type for n in fused.graph.node] == [
        "Cast", "Gather", "Mul", "Add", "Transpose", "Conv"
    ]  # fmt: skip


# --- models it cannot apply to ------------------------------------------------------------


def two_inputs() -> onnx.ModelProto:
    shape = image_shape("NCHW", 1)
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        "two",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
    )
    return make(graph)


def one_input(shape: list[int | str], dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "one",
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("y", dtype, shape)],
    )
    return make(graph)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (two_inputs(), r"exactly one input; this one has \['a', 'b'\]"),
        (one_input(["n", 16]), "has rank 2; an image input must be 4-D"),
        (one_input(["n", 4, H, W]), "must have 3 channels on axis 1"),
        (one_input(["n", 3, "h", W]), "needs a fixed height and width"),
        (one_input(["n", 3, H, W], TensorProto.INT64), "not a float32 or float16 tensor"),
    ],
)
def test_a_model_it_cannot_apply_to_is_refused_with_a_sentence(
    model: onnx.ModelProto, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        prepend(model, IMAGENET)


# --- the cached file ----------------------------------------------------------------------


def saved(tmp_path: Path, model: onnx.ModelProto, name: str = "model.onnx") -> Path:
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def test_prepended_path_is_written_once_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, cache = saved(tmp_path, conv_model()), tmp_path / "cache"
    first = prepended_path(source, IMAGENET, cache)
    assert first.parent == cache and first.name.startswith(f"{file_sha256(source)}-uint8-")
    assert session(onnx.load(str(first))).get_inputs()[0].type == "tensor(uint8)"

    def refuse(*args: Any) -> onnx.ModelProto:
        raise AssertionError("prepended again")

    monkeypatch.setattr(onnx_uint8, "prepend", refuse)
    assert prepended_path(source, IMAGENET, cache) == first
    assert files(cache) == [first.name]  # no .part left behind


def test_each_normalisation_and_model_gets_its_own_file(tmp_path: Path) -> None:
    source, cache = saved(tmp_path, conv_model()), tmp_path / "cache"
    paths = {
        prepended_path(source, norm, cache) for norm in NORMS.values() if norm.layout == "NCHW"
    }
    other = saved(tmp_path, conv_model(batch=4), "other.onnx")
    paths.add(prepended_path(other, IMAGENET, cache))
    assert len(paths) == 3 and len(files(cache)) == 3


def test_external_data_is_saved_inline(tmp_path: Path) -> None:
    source = tmp_path / "external" / "model.onnx"
    source.parent.mkdir()
    onnx.save(conv_model(), str(source), save_as_external_data=True, size_threshold=0)
    path = prepended_path(source, IMAGENET, tmp_path / "cache")
    model = onnx.load(str(path), load_external_data=False)
    assert all(not t.external_data for t in model.graph.initializer)
    fused = session(model).run(None, {"pixels": pixels(1)})[0]
    reference = session(conv_model()).run(None, {"pixels": IMAGENET(np, pixels(1))})[0]
    np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-5)


# --- which engines get it -----------------------------------------------------------------


def request_for(tmp_path: Path, norm: Normalization | None = IMAGENET) -> EngineRequest:
    return EngineRequest("conv:1", saved(tmp_path, conv_model()), 8, (), norm)


def test_only_a_gpu_engine_with_a_normalisation_builds_from_the_prepended_file(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    request = request_for(tmp_path)
    assert engine_onnx(request, False, cache) == request.onnx_path
    assert engine_onnx(request_for(tmp_path, None), True, cache) == request.onnx_path
    assert engine_onnx(request, True, cache) == prepended_path(request.onnx_path, IMAGENET, cache)
    assert len(files(cache)) == 1  # the CPU and the unnormalised asks wrote nothing


def factory(tmp_path: Path, host: Host) -> EngineFactory:
    settings = Settings(data_dir=tmp_path / "data")
    return EngineFactory(settings, LocalStore(tmp_path / "store"), host=host)


def test_onnxruntime_on_the_cpu_keeps_the_float_graph(tmp_path: Path) -> None:
    cpu = Host(tensorrt=False, gpus=(), ort_providers=("CPUExecutionProvider",), cpus=2)
    made = factory(tmp_path, cpu)
    engine = made._onnxruntime(request_for(tmp_path), Choice("onnxruntime-cpu", "test"))
    assert [(i.name, i.dtype) for i in engine.inputs] == [("pixels", "float32")]
    assert made.settings.model_cache_dir is not None
    assert not list(made.settings.model_cache_dir.glob("*-uint8-*.onnx"))


class Recorded:
    """Stands in for a GPU engine builder: keeps what it was asked to build from."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Recorded:
        self.calls.append((*args, kwargs))
        return self


GPU = Host(
    tensorrt=True,
    gpus=(H100,),
    ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"),
    cpus=16,
)


def test_onnxruntime_cuda_builds_from_the_prepended_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = Recorded()
    monkeypatch.setattr(select, "OnnxRuntimeEngine", recorded)
    made = factory(tmp_path, GPU)
    request = request_for(tmp_path)
    made._onnxruntime(request, Choice("onnxruntime-cuda", "test"))
    (path, options), cache = recorded.calls[0], made.settings.model_cache_dir
    assert cache is not None
    assert path == prepended_path(request.onnx_path, IMAGENET, cache)
    assert options["providers"][0] == "CUDAExecutionProvider"


def test_tensorrt_builds_from_the_prepended_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.workers.engines import tensorrt

    recorded = Recorded()
    monkeypatch.setattr(tensorrt, "build_tensorrt_engine", recorded)
    made = factory(tmp_path, GPU)
    request = request_for(tmp_path)
    made._tensorrt(request, Choice("tensorrt", "test"))
    given: EngineRequest = recorded.calls[0][0]
    assert made.settings.model_cache_dir is not None
    assert given.onnx_path == prepended_path(
        request.onnx_path, IMAGENET, made.settings.model_cache_dir
    )
    assert (given.name, given.max_batch, given.normalization) == ("conv:1", 8, IMAGENET)


def files(cache: Path) -> list[str]:
    """The files in the model cache, less the hashes it keeps of them (`learned/`)."""
    return [p.name for p in cache.iterdir() if p.name != "learned"]
