"""The torch engine driven the GPU's way, its logic run on the CPU: the uint8 contract (pixels
in, normalised by the engine), staging buffers a batch is gathered into, CUDA graphs per batch
bucket behind an eager stand-in for the capture, and FP16 weights with their fallback.

torch runs in one child process (as in test_torch_engine): this process stays torch-free. The
child writes what it found; this process compares with ONNX Runtime over the original graph
fed NumPy's normalisation. What only a GPU shows (pinned memory, streams, real graph capture and
replay, FP16 speed) is in tests/gpu.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from kiln.workers.engines.cuda_graphs import bucket_for, buckets
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.uint8_input import Normalization
from tests.support import run_torch_child

NORM = Normalization(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
SIZE = 32
RTOL, ATOL = 1e-4, 1e-4  # the same FP32 graph, different kernels (test_torch_engine: 1e-3)
ATOL_FP16 = 2e-2  # FP16 weights and activations: 10-bit mantissas over a few layers

CHILD = """
import sys
from tests.workers.engines.test_torch_uint8 import run_torch
run_torch(sys.argv[1])
"""


# --- the child (torch) --------------------------------------------------------------------


def export(path: Path, scale: float = 1.0) -> Path:
    """A small convolutional classifier (logits); `scale` multiplies its output, so a large
    one overflows FP16."""
    import torch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 5),
            )  # fmt: skip

        def forward(self, x: Any) -> Any:
            return self.body(x) * scale

    with warnings.catch_warnings():  # torch 2.9-2.12 call the TorchScript exporter legacy
        warnings.simplefilter("ignore", DeprecationWarning)
        batch = {0: "batch"}
        torch.onnx.export(Net().eval(), (torch.rand(2, 3, SIZE, SIZE),), str(path),
                          dynamo=False, opset_version=17, input_names=["images"],
                          output_names=["logits"],
                          dynamic_axes={"images": batch, "logits": batch})  # fmt: skip
    model = onnx.load(str(path))
    model.ir_version = min(model.ir_version, 10)  # onnxruntime refuses newer IRs
    onnx.save(model, str(path))
    return path


class EagerCapture:
    """The capture stand-in: `replay` runs the forward pass again on the static inputs and
    writes into the static outputs, as a graph replay does."""

    def __init__(self) -> None:
        self.captured: list[int] = []

    def __call__(self, forward: Any, inputs: list[Any], pool: Any) -> Any:
        self.captured.append(int(inputs[0].shape[0]))
        outputs = forward(inputs)
        return Replayed(forward, inputs, outputs)


class Replayed:
    def __init__(self, forward: Any, inputs: list[Any], outputs: list[Any]) -> None:
        self.forward, self.inputs, self.outputs = forward, inputs, outputs
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for static, fresh in zip(self.outputs, self.forward(self.inputs), strict=True):
            static.copy_(fresh)


def engine(path: Path, **changes: Any) -> Any:
    from kiln.workers.engines.base import EngineRequest
    from kiln.workers.engines.torch_engine import (
        Options,
        TorchEngine,
        build_torch_engine,
        checked_engine,
    )

    capture = changes.pop("capture", None)
    built = build_torch_engine(EngineRequest("c", path, 8, normalization=NORM), "cpu", 1)
    if not changes and capture is None:
        return built
    options = Options(**{**built.options.__dict__, **changes})
    if changes.get("half_weights"):
        return checked_engine(built._module.float(), built.model_inputs, built.outputs, options)
    return TorchEngine(built._module, built.model_inputs, built.outputs, options, capture)


def run_torch(where: str) -> None:
    folder = Path(where)
    path = export(folder / "classifier.onnx")
    report: dict[str, Any] = {}
    pixels = dict(np.load(folder / "pixels.npz"))
    plain = engine(path)
    report["inputs"] = [[s.name, list(s.shape), s.dtype] for s in plain.inputs]
    outputs = {name: plain.infer({"images": batch})["logits"] for name, batch in pixels.items()}
    report["normalisations"] = normalisations()
    report["buffer"] = gathered_into_the_buffer(plain, pixels["b5"])
    report["graphs"] = replayed(path, pixels, outputs)
    report["capture_fails"] = capture_fails(path, pixels["b3"])
    report["fp16"] = half_weights(folder, path, pixels["b5"])
    np.savez(folder / "outputs.npz", **outputs)
    (folder / "report.json").write_text(json.dumps(report))


def normalisations() -> dict[str, Any]:
    """`TorchNormalization` against NumPy's `normalize` for each order, layout and dtype; NCHW
    comes out channels_last (NHWC memory), which is what the module's weights are in."""
    import torch

    from kiln.workers.engines.uint8_input import TorchNormalization

    batch = np.random.default_rng(3).integers(0, 256, (4, 6, 5, 3), dtype=np.uint8)
    found: dict[str, Any] = {}
    for order in ("RGB", "BGR"):
        for layout in ("NCHW", "NHWC"):
            for dtype in ("float32", "float16"):
                norm = Normalization(NORM.mean, NORM.std, NORM.scale, order, layout)
                ours = TorchNormalization(norm, "cpu", getattr(torch, dtype))(
                    torch.from_numpy(batch)
                )
                theirs = norm(np, batch, dtype)
                found[f"{order}-{layout}-{dtype}"] = {
                    "max": float(np.abs(ours.float().numpy() - theirs.astype(np.float32)).max()),
                    "dtype": str(ours.dtype).removeprefix("torch."),
                    "channels_last": bool(ours.is_contiguous(memory_format=torch.channels_last)),
                    "shape": list(ours.shape),
                }
    return found


def gathered_into_the_buffer(plain: Any, batch: np.ndarray) -> dict[str, Any]:
    """A batch gathered into the engine's staging buffer is read where it lies."""
    buffer = plain.host_buffer(batch.shape)
    buffer[:] = batch
    held = plain._transfers.held(plain.inputs[0].name, buffer)
    again = plain.host_buffer(batch.shape)
    return {
        "same_memory": held.data_ptr() == buffer.ctypes.data,
        "reused": again.ctypes.data == buffer.ctypes.data,
        "equal": bool(np.array_equal(plain.infer({"images": buffer})["logits"],
                                     plain.infer({"images": batch.copy()})["logits"])),
    }  # fmt: skip


def replayed(path: Path, pixels: dict[str, np.ndarray], eager: dict[str, Any]) -> dict[str, Any]:
    """Batches of 1, 3, 5 and 8 through graph buckets 1, 4, 8 (3 → 4, 5 → 8, padded); a
    small batch after a full one does not see its rows; two runners each borrow a set."""
    from concurrent.futures import ThreadPoolExecutor

    capture = EagerCapture()
    graphed = engine(path, graphs=True, runners=2, capture=capture)
    order = ["b8", "b1", "b3", "b5", "b8", "b3"]
    same = {}
    for name in order:
        out = graphed.infer({"images": pixels[name]})["logits"]
        same[name] = float(np.abs(out - eager[name]).max())
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: graphed.infer({"images": pixels[n]}), ["b5", "b3"] * 4))
    threaded = all(
        np.abs(r["logits"] - eager[n]).max() < 1e-5
        for r, n in zip(results, ["b5", "b3"] * 4, strict=True)
    )
    halves = staged_halves(engine(path, graphs=True, capture=EagerCapture()), pixels, eager)
    assert graphed.graphs is not None
    counted = graphed.graphs.captured()
    graphed.close()
    warmed = engine(path, graphs=True, runners=2, capture=EagerCapture())
    warmed.warm()  # what build_torch_engine does on a GPU: every bucket, every set, at load
    assert warmed.graphs is not None
    return {"max_diff": same, "captured": sorted(capture.captured), "counted": counted,
            "threaded": threaded, "closed": graphed.graphs is None, "halves": halves,
            "warmed": warmed.graphs.captured(), "warm_reason": warmed.reason}  # fmt: skip


def staged_halves(
    graphed: Any, pixels: dict[str, np.ndarray], eager: dict[str, Any]
) -> dict[str, float]:
    """The device stages' forward and outputs stages (`forward_tensors`, `outputs_to_host`):
    through the graphs, each batch's logits are the eager ones, a later batch not seen."""
    import torch

    worst = {}
    for name in ("b8", "b3", "b1", "b5"):
        values = graphed.forward_tensors({"images": torch.from_numpy(pixels[name])})
        out = graphed.outputs_to_host(values, len(pixels[name]))["logits"]
        worst[name] = float(np.abs(out - eager[name]).max())
    return worst


def capture_fails(path: Path, batch: np.ndarray) -> dict[str, Any]:
    def refuse(forward: Any, inputs: list[Any], pool: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphed = engine(path, graphs=True, capture=refuse)
    out = graphed.infer({"images": batch})["logits"]
    plain = engine(path).infer({"images": batch})["logits"]
    return {"equal": bool(np.allclose(out, plain, atol=1e-6)), "graphs": graphed.graphs is None,
            "reason": graphed.reason}  # fmt: skip


def half_weights(folder: Path, path: Path, batch: np.ndarray) -> dict[str, Any]:
    """FP16 weights (checked on the CPU through the same code) near FP32; a model whose FP16
    output overflows keeps FP32 weights, and says so."""
    full = engine(path)
    half = engine(path, half_weights=True, precision="fp16")
    overflowing = export(folder / "overflow.onnx", scale=1e6)
    kept = engine(overflowing, half_weights=True, precision="fp16")
    return {
        "max_diff": float(np.abs(half.infer({"images": batch})["logits"]
                                 - full.infer({"images": batch})["logits"]).max()),
        "memory": [full.memory_bytes, half.memory_bytes],
        "half": half.options.half_weights,
        "kept_half": kept.options.half_weights,
        "kept_reason": kept.reason,
        "kept_finite": bool(np.isfinite(kept.infer({"images": batch})["logits"]).all()),
    }  # fmt: skip


# --- this process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("torch-uint8")
    rng = np.random.default_rng(11)
    pixels = {f"b{n}": rng.integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8)
              for n in (1, 3, 5, 8)}  # fmt: skip
    np.savez(folder / "pixels.npz", **pixels)
    run_torch_child(CHILD, folder)
    return folder, json.loads((folder / "report.json").read_text())


def test_the_engine_takes_uint8_pixels_and_matches_onnxruntime(
    torch_run: tuple[Path, dict[str, Any]],
) -> None:
    """Declared uint8 NHWC; the logits are ONNX Runtime's over NumPy's normalisation."""
    folder, report = torch_run
    assert report["inputs"] == [["images", ["batch", SIZE, SIZE, 3], "uint8"]]
    reference = OnnxRuntimeEngine(folder / "classifier.onnx", max_batch=8)
    pixels, outputs = np.load(folder / "pixels.npz"), np.load(folder / "outputs.npz")
    for name in pixels.files:
        theirs = reference.infer({"images": pixels[name]}, {"images": NORM})["logits"]
        np.testing.assert_allclose(outputs[name], theirs, rtol=RTOL, atol=ATOL, err_msg=name)


def test_torch_normalisation_is_numpys(torch_run: tuple[Path, dict[str, Any]]) -> None:
    found = torch_run[1]["normalisations"]
    assert len(found) == 8
    for name, seen in found.items():
        assert seen["max"] <= (1e-6 if seen["dtype"] == "float32" else 2e-3), name
        assert seen["dtype"] == name.rsplit("-", 1)[1], name
        if "NCHW" in name:
            assert seen["shape"] == [4, 3, 6, 5] and seen["channels_last"], name
        else:
            assert seen["shape"] == [4, 6, 5, 3], name


def test_a_batch_gathered_into_the_staging_buffer_is_not_copied(
    torch_run: tuple[Path, dict[str, Any]],
) -> None:
    assert torch_run[1]["buffer"] == {"same_memory": True, "reused": True, "equal": True}


def test_buckets_are_powers_of_two_up_to_the_batch() -> None:
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert buckets(1) == [1]
    assert [bucket_for(n, buckets(100)) for n in (1, 3, 5, 64, 65, 100)] == [1, 4, 8, 64, 100, 100]
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket_for(101, buckets(100))


def test_graphs_replay_padded_batches_per_bucket(torch_run: tuple[Path, dict[str, Any]]) -> None:
    """Each batch through its bucket's graph gives the eager logits (padding rows unread);
    buckets are captured once per runner's set, on first use; `close` drops them."""
    found = torch_run[1]["graphs"]
    assert max(found["max_diff"].values()) < 1e-5
    assert found["threaded"]
    assert max(found["halves"].values()) < 1e-5
    # one set captured 8, 1, 4 (sequential calls), the second set what the threads needed
    assert found["counted"]["8"] >= 1 and found["counted"]["4"] >= 1 and found["counted"]["1"] == 1
    assert set(found["captured"]) == {1, 4, 8}
    assert found["closed"]
    assert found["warmed"] == {"1": 2, "2": 2, "4": 2, "8": 2}
    assert "4 CUDA graphs per runner captured in" in found["warm_reason"]


def test_a_graph_that_cannot_be_captured_runs_eagerly(
    torch_run: tuple[Path, dict[str, Any]],
) -> None:
    found = torch_run[1]["capture_fails"]
    assert found["equal"] and found["graphs"]
    assert "CUDA graphs off: operation not permitted when stream is capturing" in found["reason"]


def test_fp16_weights_and_their_fallback(torch_run: tuple[Path, dict[str, Any]]) -> None:
    found = torch_run[1]["fp16"]
    assert found["half"] and 0 < found["max_diff"] <= ATOL_FP16
    full, half = found["memory"]
    assert half == pytest.approx(full / 2, rel=0.05)
    assert not found["kept_half"] and found["kept_finite"]
    assert "FP32 weights: an output is not finite" in found["kept_reason"]
