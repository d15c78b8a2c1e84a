"""Every GPU backend Kiln can choose, on a real NVIDIA GPU: ONNX Runtime's CUDA provider and the
PyTorch backend run the built-in detector and match ONNX Runtime on the CPU, the engine alone and
the predictor as a worker drives it (on the PyTorch engine with nvJPEG, images decoded, fitted
and normalised on the GPU); `auto` ranks them; the engines account for their memory.

Each backend is skipped, with the reason, where its pieces are missing; with KILN_REQUIRE_GPU=1
(`make gpu-check`) a missing GPU is an error, and so is a backend that `kiln doctor` lists as
usable but that fails here.
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image

from devstack.images import photo, truncated_jpeg
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError
from kiln.app.storage.local import LocalStore
from kiln.workers.device.pixels import nvjpeg_available
from kiln.workers.engines.base import MemoryAccount
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.select import EngineFactory, Host, candidates
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.models.detect import DetectorPredictor, YoloPredictor, model_path
from kiln.workers.models.direct import run_direct
from kiln.workers.ops.device import list_gpus
from tests.workers.models.halves import Row, batch_of, prepare
from tests.workers.models.yolo import LABELS as YOLO_LABELS
from tests.workers.models.yolo import SIZE as YOLO_SIZE
from tests.workers.models.yolo import tiny_yolo

GPUS = list_gpus()
if not GPUS and os.environ.get("KILN_REQUIRE_GPU") == "1":
    raise RuntimeError("KILN_REQUIRE_GPU=1, but no NVIDIA GPU is visible (NVML).")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible (NVML)"),
]

TOLERANCE = {"fp32": (1e-3, 1e-2), "fp16": (2e-2, 0.5)}  # boxes are in pixels (up to 320)
MAX_PIXELS = 50_000_000
# PNGs: Pillow decodes them on either path (nvJPEG takes JPEGs only), so the device path differs
# from the CPU's by its resize alone (torch's antialiased kernels against Pillow's: a couple of
# levels; on the CPU device, tests/workers/models/test_device_path.py measured raw outputs
# within 0.54 model pixels). JPEGs: the CPU path drafts them (a 1/2-scale DCT decode), nvJPEG
# decodes them whole: the class scores stay close, as between a draft and a full decode on the
# CPU (tests/workers/models/test_decode_draft.py).
PNGS = [photo(1, (640, 480), "PNG"), photo(2, (300, 500), "PNG")]
JPEGS = [photo(seed, (640, 480)) for seed in (3, 4, 5)]
DEVICE_ATOL = 1.0  # raw outputs of the PNGs: box centres and sizes in model pixels, and scores
DRAFT_SCORES = 0.05  # class scores of the JPEGs, drafted on the CPU, whole on the GPU
SURE, MARGIN = 0.5, 0.15  # a detection either path is sure of, and how far below the other may be


def _torch_cuda() -> str | None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnx2fx") is None:
        return "torch or onnx2fx is not installed"
    import torch

    return None if torch.cuda.is_available() else "torch does not see CUDA"


def _ort_cuda() -> str | None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "ONNX Runtime has no CUDA provider (is onnxruntime-gpu alone installed?)"
    return None


# Probed only on a GPU host: importing torch elsewhere would make this process no longer the
# torch-free worker the CPU tests check for.
MISSING = {"onnxruntime-cuda": _ort_cuda(), "torch-cuda": _torch_cuda()} if GPUS else {}


def _factory(tmp_path: Path, backend: str) -> EngineFactory:
    settings = Settings(data_dir=tmp_path, engine=backend)
    return EngineFactory(settings, LocalStore(tmp_path / "store"))


def _batch() -> dict[str, np.ndarray]:
    pixels = np.random.default_rng(0).random((4, 3, 320, 320), dtype=np.float32)
    return {"images": pixels}


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "torch-cuda"])
def test_the_detector_matches_the_cpu(tmp_path: Path, backend: str) -> None:
    if MISSING[backend]:
        pytest.skip(MISSING[backend] or "")
    engine = _factory(tmp_path, backend).build("detector", model_path(), 8)
    assert "cuda" in engine.backend.lower() or engine.backend.startswith("onnxruntime:CUDA")
    reference = OnnxRuntimeEngine(model_path(), max_batch=8)
    feeds = {reference.inputs[0].name: _batch()["images"]}
    ours, cpu = engine.infer(feeds), reference.infer(feeds)
    rtol, atol = TOLERANCE["fp16" if engine.backend.endswith("fp16") else "fp32"]
    for name, expected in cpu.items():
        np.testing.assert_allclose(ours[name], expected, rtol=rtol, atol=atol)
    assert not isinstance(engine, MemoryAccount) or engine.memory_bytes > 0


def _labels(detections: list[dict[str, Any]], floor: float) -> Counter[str]:
    return Counter(d["label"] for d in detections if d["score"] >= floor)


def _raw(predictor: DetectorPredictor, inputs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """The engine's output and the batch's fit rows for one batch of `inputs`, as a worker
    gathers it from prep's rows (pixels in slots, or (bytes, header) objects for the GPU
    decoder, whose fits `_output` records in the batch's meta)."""
    rows: list[Row] = [prepare(predictor, data) for data in inputs]
    batch = batch_of(rows)
    output, failed = predictor._output(batch)
    assert not failed, failed
    assert batch.meta is not None
    return output, batch.meta


@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "torch-cuda"])
def test_the_detector_predictor_answers_as_on_the_cpu(tmp_path: Path, backend: str) -> None:
    """The built-in detector as a worker runs it on each GPU backend: its prep half, then its
    batch half over one batch — uint8 pixels normalised on the device, or, on the PyTorch CUDA
    engine with nvJPEG, rows of (bytes, header) decoded, fitted and normalised on the GPU.
    Raw outputs, fits and answers match the CPU predictor's; a JPEG that does not decode fails
    its own row with the CPU's sentence."""
    if MISSING[backend]:
        pytest.skip(MISSING[backend] or "")
    norm = Normalization.of(DetectorPredictor.preprocessing())  # as the loader builds it
    engine = _factory(tmp_path, backend).build("detector", model_path(), 8, (), norm)
    gpu = DetectorPredictor(engine, max_pixels=MAX_PIXELS)
    cpu = DetectorPredictor(OnnxRuntimeEngine(model_path(), max_batch=8), max_pixels=MAX_PIXELS)
    on_device = backend == "torch-cuda" and nvjpeg_available(str(getattr(engine, "device", "")))
    assert (gpu.device is not None) == on_device
    assert (gpu.prep.layout is None) == on_device  # the bytes travel on; prep reads headers
    rtol, atol = TOLERANCE["fp16" if engine.backend.endswith("fp16") else "fp32"]

    ours, our_fits = _raw(gpu, [*PNGS, *JPEGS])
    theirs, their_fits = _raw(cpu, [*PNGS, *JPEGS])
    np.testing.assert_array_equal(our_fits, their_fits)  # the same letterbox: boxes map back
    pngs = len(PNGS)
    worst = np.abs(ours - theirs).max(axis=(1, 2))
    print(f"\n{engine.backend}, on device {on_device}: max |gpu - cpu| per image {worst}")
    if on_device:
        np.testing.assert_allclose(ours[:pngs], theirs[:pngs], rtol=rtol, atol=DEVICE_ATOL)
        scores, reference = ours[pngs:, 4:], theirs[pngs:, 4:]  # [images, classes, anchors]
        assert np.abs(scores - reference).max() < DRAFT_SCORES
        top = scores.max(axis=2).argmax(axis=1)
        assert (top == reference.max(axis=2).argmax(axis=1)).all()  # each image's top class
    else:  # the same pixels on both: the engine's arithmetic alone differs
        np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol)

    inputs = [*PNGS, truncated_jpeg(), *JPEGS]
    answers = run_direct(gpu, inputs)
    expected = run_direct(cpu, inputs)
    for i, (answer, reference_answer) in enumerate(zip(answers, expected, strict=True)):
        if isinstance(reference_answer, InputError):
            assert isinstance(answer, InputError), (i, answer)
            assert str(answer) == str(reference_answer)  # the sentence the CPU gives
            continue
        assert isinstance(answer, dict) and isinstance(reference_answer, dict), (i, answer)
        ours_found, cpu_found = answer["detections"], reference_answer["detections"]
        print(f"image {i}: {_labels(ours_found, 0)} (cpu {_labels(cpu_found, 0)})")
        # What either finds with confidence, the other finds too (scores differ a little).
        assert _labels(cpu_found, SURE) <= _labels(ours_found, SURE - MARGIN), i
        assert _labels(ours_found, SURE) <= _labels(cpu_found, SURE - MARGIN), i
    assert isinstance(expected[pngs], InputError)  # the truncated JPEG


def _solid(size: tuple[int, int], colour: tuple[int, int, int], fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.mark.parametrize("resize_filter", ["bilinear", "lanczos"])
@pytest.mark.parametrize("backend", ["onnxruntime-cuda", "torch-cuda"])
def test_a_registered_detectors_boxes_map_back_as_on_the_cpu(
    tmp_path: Path, backend: str, resize_filter: str
) -> None:
    """A registered detector (the tiny YOLO of tests/workers/models/yolo.py: scores are the
    mean red and blue as fed, boxes fixed in model pixels) on each GPU backend: the boxes it
    answers, mapped back to each image's pixels by the fit its batch recorded (on the device
    path, the fit the GPU made), are the CPU's. Lanczos has no torch kernel: that model's
    images are fitted by prep on the CPU and normalised on the GPU by the engine."""
    if MISSING[backend]:
        pytest.skip(MISSING[backend] or "")
    path = tiny_yolo(tmp_path / "yolo.onnx")
    declared = ImageModelSpec(input_size=YOLO_SIZE, labels=YOLO_LABELS, resize_filter=resize_filter)
    spec = declared.stored("detect")
    norm = Normalization.of(declared.preprocessing("detect"))  # as the loader builds it
    engine = _factory(tmp_path, backend).build("boxes:1", path, 8, (), norm)
    gpu = YoloPredictor("boxes:1", engine, spec, max_pixels=MAX_PIXELS)
    if resize_filter == "lanczos":
        assert gpu.device is None and gpu.prep.layout is not None  # slots of fitted pixels
    cpu = YoloPredictor(
        "boxes:1", OnnxRuntimeEngine(path, max_batch=8), spec, max_pixels=MAX_PIXELS
    )
    images = [
        _solid((64, 48), (255, 0, 0), "PNG"),  # letterboxed: the mean red is 0.75
        _solid((64, 64), (255, 0, 255), "JPEG"),  # red and blue (nvJPEG on the device path)
        _solid((30, 90), (10, 200, 255), "JPEG"),  # tall: padded on the right
    ]
    answers, expected = run_direct(gpu, images), run_direct(cpu, images)
    for answer, reference in zip(answers, expected, strict=True):
        assert isinstance(answer, dict) and isinstance(reference, dict), (answer, reference)
        print(f"\n{engine.backend}: {answer['detections']} (cpu {reference['detections']})")
        assert reference["detections"]  # something to compare
        assert [d["label"] for d in answer["detections"]] == [
            d["label"] for d in reference["detections"]
        ]
        for ours, theirs in zip(answer["detections"], reference["detections"], strict=True):
            assert ours["score"] == pytest.approx(theirs["score"], abs=0.01)
            np.testing.assert_allclose(ours["box"], theirs["box"], atol=0.5)


def test_auto_ranks_the_gpu_backends_present() -> None:
    host = Host.probe()
    ranked = [c.backend for c in candidates(host)]
    assert ranked[-1] == "onnxruntime-cpu"
    for backend, missing in MISSING.items():
        assert (backend in ranked) == (missing is None), (backend, missing)
