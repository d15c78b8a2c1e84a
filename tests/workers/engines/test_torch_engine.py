"""The PyTorch engine agrees with ONNX Runtime on every built-in model's graph.

torch runs in one child process only (as in test_text_embed): this process stays torch-free,
like a worker, because device pinning refuses to run once torch is imported. The child builds
`TorchEngine`s (CPU) and writes their outputs; this process runs `OnnxRuntimeEngine` on the
same feeds and compares. Nothing here needs a GPU; the CUDA and FP16-on-CUDA paths have not
run here (FP16 is exercised on the CPU through the same autocast code).
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.workers.engines.base import BackendUnavailableError, EngineRequest, Prepare
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.torch_engine import (
    backend_name,
    build_torch_engine,
    decide_device,
    graph_specs,
    torch_precision,
)
from kiln.workers.models.detect import model_path
from kiln.workers.models.ocr_config import load_config
from kiln.workers.models.text_embed import source_folder
from kiln.workers.prep.pixels import normalize
from tests.support import run_torch_child

# FP32: the same graph, different kernels and summation orders. Measured maxima of
# |torch - onnxruntime| over runs: detector ≤ 2.0e-4 (box coordinates up to 320), OCR det
# 2.3e-5, rec ≤ 4.1e-6, cls ≤ 2.4e-6, text embedder 1.5e-7, classifier 6e-8.
RTOL, ATOL = 1e-3, 1e-3
# FP16 under autocast (the classifier only): 10-bit mantissas; measured ≤ 1.1e-4 on the CPU.
RTOL_FP16, ATOL_FP16 = 1e-2, 1e-2
UNSUPPORTED_OP = "MaxRoiPool"  # a standard ONNX op that onnx2fx has no handler for
THREADS = 4

CHILD = """
import sys
from tests.workers.engines.test_torch_engine import run_torch
run_torch(sys.argv[1])
"""


@dataclass(frozen=True)
class Case:
    """One engine and the batches it is fed (different shapes: the dynamic axes)."""

    name: str
    onnx: str
    batches: list[dict[str, np.ndarray]]
    prepare: str | None = None  # a key of `preparers()`
    precision: str = "fp32"


def preparers() -> dict[str, Prepare]:
    det = load_config()
    return {
        "detector": normalize,
        "ocr-det": lambda xp, x: normalize(xp, x, mean=det.det_mean, std=det.det_std),
    }


# --- the feeds (this process) -------------------------------------------------------------


def text_image(height: int, width: int, text: str) -> np.ndarray:
    image = np.full((height, width, 3), 255, np.uint8)
    cv2.putText(image, text, (8, height * 2 // 3), cv2.FONT_HERSHEY_SIMPLEX, 1.2, (0, 0, 0), 2)
    return image


def tokens(texts: list[str]) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    folder = source_folder()
    assert folder is not None, "the all-MiniLM-L6-v2 package (kiln[torch]) is not installed"
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding()
    encoded = tokenizer.encode_batch(texts)
    return {
        "input_ids": np.array([e.ids for e in encoded], np.int64),
        "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
        "token_type_ids": np.array([e.type_ids for e in encoded], np.int64),
    }


def unsupported_model(path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=[2, 2])],
        "unsupported",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8]),
            helper.make_tensor_value_info("rois", TensorProto.FLOAT, ["R", 5]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["R", 1, 2, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def cases(folder: Path) -> list[Case]:
    config, rng = load_config(), np.random.default_rng(7)

    def pixels(*shape: int) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8)

    def strips(*shape: int) -> np.ndarray:
        return rng.uniform(-1, 1, shape).astype(np.float32)  # cls/rec inputs: (x/255-.5)/.5

    images = strips(5, 3, 32, 32)  # the classifier's, in FP32 and in FP16
    return [
        Case("detector", str(model_path()),
             [{"images": pixels(3, 320, 320, 3)}, {"images": pixels(1, 256, 320, 3)}],
             prepare="detector"),
        Case("ocr-det", str(config.det_model),
             [{"x": np.stack([text_image(96, 320, "Kiln 2024"), text_image(96, 320, "fired")])}],
             prepare="ocr-det"),
        Case("ocr-cls", str(config.cls_model), [{"x": strips(4, 3, 48, 192)}]),
        Case("ocr-rec", str(config.rec_model),
             [{"x": strips(3, 3, 48, 320)}, {"x": strips(2, 3, 48, 160)}]),
        Case("text-embed", str(folder / "text-embed.onnx"),
             [tokens(["A man is eating food.", "Kiln fires clay.", "Short"]),
              tokens(["kiln fires clay into stoneware " * 20])]),
        Case("classifier", str(folder / "classifier.onnx"), [{"images": images}]),
        Case("classifier-fp16", str(folder / "classifier.onnx"),
             [{"images": images}], precision="fp16"),
    ]  # fmt: skip


def save(path: Path, arrays: dict[str, Any]) -> None:
    np.savez(path, **arrays)


def write_cases(folder: Path, found: list[Case]) -> None:
    listing = []
    for case in found:
        for i, batch in enumerate(case.batches):
            save(folder / f"{case.name}.in{i}.npz", batch)
        listing.append({"name": case.name, "onnx": case.onnx, "batches": len(case.batches),
                        "prepare": case.prepare, "precision": case.precision})  # fmt: skip
    (folder / "cases.json").write_text(json.dumps(listing))


# --- the child (torch) --------------------------------------------------------------------


def run_torch(where: str) -> None:
    """Export the torch-made models, run every case through TorchEngine, save the outputs,
    and record what the builds that must fail said."""
    folder = Path(where)
    export_models(folder)
    report: dict[str, Any] = {"backends": {}, "errors": {}, "seconds": {}, "memory": {}}
    for case in json.loads((folder / "cases.json").read_text()):
        started = time.perf_counter()
        engine = torch_engine(case)
        report["backends"][case["name"]] = engine.backend
        report["memory"][case["name"]] = engine.memory_bytes
        step = preparers()[case["prepare"]] if case["prepare"] else None
        for i in range(case["batches"]):
            feeds = dict(np.load(folder / f"{case['name']}.in{i}.npz"))
            steps = {name: step for name in feeds} if step else None
            save(folder / f"{case['name']}.out{i}.npz", engine.infer(feeds, steps))
        report["seconds"][case["name"]] = round(time.perf_counter() - started, 2)
    run_concurrently(folder)
    report["errors"] = failing_builds(folder)
    (folder / "report.json").write_text(json.dumps(report))


def export_models(folder: Path) -> None:
    import torch

    from kiln.workers.models.text_embed import _export_onnx  # the export workers use

    source = source_folder()
    assert source is not None, "the all-MiniLM-L6-v2 package (kiln[torch]) is not installed"
    _export_onnx(source, folder / "text-embed.onnx")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 5),
    ).eval()  # fmt: skip  (logits, not probabilities: a softmax would hide FP16 error)
    path = folder / "classifier.onnx"
    torch.onnx.export(net, (torch.rand(2, 3, 32, 32),), str(path), dynamo=False,
                      opset_version=17, input_names=["images"], output_names=["logits"],
                      dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})  # fmt: skip
    model = onnx.load(str(path))
    model.ir_version = min(model.ir_version, 10)  # onnxruntime refuses newer IRs
    onnx.save(model, str(path))


def torch_engine(case: dict[str, Any]) -> Any:
    from kiln.workers.engines.torch_engine import Options, TorchEngine

    built = build_torch_engine(EngineRequest(case["name"], Path(case["onnx"]), 8), "cpu", 1)
    if case["precision"] == "fp32":
        return built
    # FP16 is chosen only on CUDA; the same autocast path, run on the CPU here.
    options = Options("cpu", "fp16", 8, reason="test")
    return TorchEngine(built._module, built.inputs, built.outputs, options)


def run_concurrently(folder: Path) -> None:
    """THREADS runners share one engine, each with its own batch, several times over."""
    engine = build_torch_engine(EngineRequest("c", folder / "classifier.onnx", 8), "cpu", 2)
    batches = [dict(np.load(folder / f"threads.in{i}.npz")) for i in range(THREADS)]

    def run(i: int) -> dict[str, np.ndarray]:
        results = [engine.infer(batches[i]) for _ in range(5)]
        assert all(np.array_equal(r["logits"], results[0]["logits"]) for r in results)
        return results[-1]

    with ThreadPoolExecutor(THREADS) as pool:
        for i, result in enumerate(pool.map(run, range(THREADS))):
            save(folder / f"threads.out{i}.npz", result)


def failing_builds(folder: Path) -> dict[str, str]:
    """What the builds say for an op onnx2fx lacks and for a missing onnx2fx."""
    errors = {}
    for name, path in (("unsupported", folder / "unsupported.onnx"),):
        try:
            build_torch_engine(EngineRequest(name, path, 8), "cpu", 1)
        except BackendUnavailableError as error:
            errors[name] = str(error)
    sys.modules["onnx2fx"] = None  # type: ignore[assignment]  # as where it is not installed
    try:
        build_torch_engine(EngineRequest("c", folder / "classifier.onnx", 8), "cpu", 1)
    except BackendUnavailableError as error:
        errors["no-onnx2fx"] = str(error)
    return errors


# --- this process: the reference and the comparisons -------------------------------------


@dataclass(frozen=True)
class TorchRun:
    folder: Path
    cases: list[Case]
    report: dict[str, Any]


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> TorchRun:
    folder = tmp_path_factory.mktemp("torch")
    found = cases(folder)
    write_cases(folder, found)
    rng = np.random.default_rng(11)
    for i in range(THREADS):
        np.savez(folder / f"threads.in{i}.npz",
                 images=rng.uniform(-1, 1, (i + 1, 3, 32, 32)).astype(np.float32))  # fmt: skip
    unsupported_model(folder / "unsupported.onnx")
    run_torch_child(CHILD, folder, env={"HF_HUB_OFFLINE": "1"})
    return TorchRun(folder, found, json.loads((folder / "report.json").read_text()))


def reference(path: str, feeds: dict[str, np.ndarray], step: Prepare | None) -> Any:
    engine = OnnxRuntimeEngine(Path(path), max_batch=8, threads=1)
    return engine.infer(feeds, {name: step for name in feeds} if step else None)


def compare(
    name: str,
    ours: dict[str, np.ndarray],
    theirs: dict[str, np.ndarray],
    tolerance: tuple[float, float],
) -> None:
    assert ours.keys() == theirs.keys()
    for key, expected in theirs.items():
        assert ours[key].dtype == expected.dtype and ours[key].shape == expected.shape, key
        worst = float(np.abs(ours[key].astype(np.float64) - expected).max(initial=0.0))
        print(f"\n{name} {key} {expected.shape}: max |torch - onnxruntime| = {worst:.3g}")
        np.testing.assert_allclose(ours[key], expected, rtol=tolerance[0], atol=tolerance[1])


@pytest.mark.parametrize(
    "name",
    ["detector", "ocr-det", "ocr-cls", "ocr-rec", "text-embed", "classifier", "classifier-fp16"],
)
def test_torch_matches_onnxruntime(torch_run: TorchRun, name: str) -> None:
    (case,) = [c for c in torch_run.cases if c.name == name]
    step = preparers()[case.prepare] if case.prepare else None
    tolerance = (RTOL_FP16, ATOL_FP16) if case.precision == "fp16" else (RTOL, ATOL)
    for i, feeds in enumerate(case.batches):
        ours = dict(np.load(torch_run.folder / f"{name}.out{i}.npz"))
        compare(name, ours, reference(case.onnx, feeds, step), tolerance)
    expected = "torch:cpu:fp16" if case.precision == "fp16" else "torch:cpu"
    assert torch_run.report["backends"][name] == expected


def test_the_engine_accounts_for_its_weights(torch_run: TorchRun) -> None:
    """What the memory budget counts: the converted module's weights, as the ONNX file holds
    them (the classifier's, in FP32)."""
    model = onnx.load(str(torch_run.folder / "classifier.onnx"))
    weights = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert weights > 0
    assert torch_run.report["memory"]["classifier"] == pytest.approx(weights, rel=0.1)


def test_fp16_really_ran_in_half_precision(torch_run: TorchRun) -> None:
    half = np.load(torch_run.folder / "classifier-fp16.out0.npz")["logits"]
    full = np.load(torch_run.folder / "classifier.out0.npz")["logits"]
    assert half.dtype == np.float32  # autocast's FP16 outputs come back as the file declares
    assert not np.array_equal(half, full)  # the same feeds: only the precision differs


def test_runner_threads_share_one_engine(torch_run: TorchRun) -> None:
    for i in range(THREADS):
        feeds = dict(np.load(torch_run.folder / f"threads.in{i}.npz"))
        ours = dict(np.load(torch_run.folder / f"threads.out{i}.npz"))
        assert ours["logits"].shape == (i + 1, 5)
        compare("threads", ours, reference(str(torch_run.folder / "classifier.onnx"), feeds, None),
                (RTOL, ATOL))  # fmt: skip


def test_an_op_onnx2fx_lacks_is_named(torch_run: TorchRun) -> None:
    error = torch_run.report["errors"]["unsupported"]
    assert UNSUPPORTED_OP in error and "onnx2fx cannot convert unsupported" in error


def test_a_missing_converter_is_a_sentence(torch_run: TorchRun) -> None:
    assert torch_run.report["errors"]["no-onnx2fx"] == (
        "The onnx2fx package (ONNX → torch) is not installed."
    )


def test_a_missing_torch_is_a_sentence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(BackendUnavailableError, match="The torch package is not installed"):
        build_torch_engine(EngineRequest("x", tmp_path / "x.onnx", 1), "cpu", 1)


# --- the decisions, without torch ---------------------------------------------------------


def test_the_device_is_cuda_when_torch_sees_it() -> None:
    assert decide_device(None, cuda_available=True) == "cuda"
    assert decide_device("auto", cuda_available=False) == "cpu"
    assert decide_device("cpu", cuda_available=True) == "cpu"
    with pytest.raises(BackendUnavailableError, match="torch sees none"):
        decide_device("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="Unknown torch device"):
        decide_device("tpu", cuda_available=False)


def test_fp16_only_on_cuda_with_tensor_cores_unless_asked() -> None:
    assert torch_precision("auto", "cuda", (8, 6)) == "fp16"
    assert torch_precision("auto", "cuda", (6, 1)) == "fp32"  # Pascal: slow FP16
    assert torch_precision("fp16", "cuda", (6, 1)) == "fp16"
    assert torch_precision("fp32", "cuda", (9, 0)) == "fp32"
    assert torch_precision("fp16", "cpu", None) == "fp32"
    assert backend_name("cuda", "fp16") == "torch:cuda:fp16"
    assert backend_name("cpu", "fp32") == "torch:cpu"


@pytest.mark.parametrize("which", ["detector", "ocr-det", "ocr-cls", "ocr-rec"])
def test_specs_are_what_onnxruntime_reads(which: str) -> None:
    config = load_config()
    path = {"detector": model_path(), "ocr-det": config.det_model,
            "ocr-cls": config.cls_model, "ocr-rec": config.rec_model}[which]  # fmt: skip
    inputs, outputs = graph_specs(onnx.load(str(path), load_external_data=False))
    session = OnnxRuntimeEngine(path, max_batch=1, threads=1)
    for ours, theirs in ((inputs, session.inputs), (outputs, session.outputs)):
        assert [(s.name, s.dtype) for s in ours] == [(s.name, s.dtype) for s in theirs]
        for mine, ort_spec in zip(ours, theirs, strict=True):
            fixed = [(a, b) for a, b in zip(mine.shape, ort_spec.shape, strict=True)
                     if isinstance(b, int)]  # fmt: skip
            assert all(a == b for a, b in fixed)
