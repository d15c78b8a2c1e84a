"""Every GPU backend Kiln can choose, on a real NVIDIA GPU: ONNX Runtime's CUDA provider and the
PyTorch backend run the built-in detector and match ONNX Runtime on the CPU; `auto` ranks them;
the engines account for their memory.

Each backend is skipped, with the reason, where its pieces are missing; with KILN_REQUIRE_GPU=1
(`make gpu-check`) a missing GPU is an error, and so is a backend that `kiln doctor` lists as
usable but that fails here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from kiln.app.core.config import Settings
from kiln.app.storage.local import LocalStore
from kiln.workers.device import list_gpus
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.select import EngineFactory, Host, candidates
from kiln.workers.models.detect import model_path

GPUS = list_gpus()
if not GPUS and os.environ.get("KILN_REQUIRE_GPU") == "1":
    raise RuntimeError("KILN_REQUIRE_GPU=1, but no NVIDIA GPU is visible (NVML).")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not GPUS, reason="no NVIDIA GPU visible (NVML)"),
]

TOLERANCE = {"fp32": (1e-3, 1e-2), "fp16": (2e-2, 0.5)}  # boxes are in pixels (up to 320)


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
    assert getattr(engine, "memory_bytes", 1) > 0


def test_auto_ranks_the_gpu_backends_present() -> None:
    host = Host.probe()
    ranked = [c.backend for c in candidates(host)]
    assert ranked[-1] == "onnxruntime-cpu"
    for backend, missing in MISSING.items():
        assert (backend in ranked) == (missing is None), (backend, missing)
