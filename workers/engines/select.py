"""Choose an engine backend for this host, and say why."""

from __future__ import annotations

import logging
from pathlib import Path

import onnxruntime as ort

from workers.engines.base import Engine
from workers.engines.onnxruntime import OnnxRuntimeEngine

log = logging.getLogger(__name__)


def choose_providers(backend: str = "auto") -> tuple[list[str], str]:
    """ONNX Runtime providers for `backend`, with the reason for the choice."""
    available = ort.get_available_providers()
    if backend in ("auto", "onnxruntime-cuda") and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], "CUDA provider available"
    if backend == "onnxruntime-cuda":
        raise RuntimeError("The onnxruntime-cuda backend needs onnxruntime-gpu and a GPU.")
    return ["CPUExecutionProvider"], "no CUDA provider in this onnxruntime build"


def build_engine(
    path: Path, *, max_batch: int, threads: int = 0, runners: int = 1, backend: str = "auto"
) -> Engine:
    providers, reason = choose_providers(backend)
    engine = OnnxRuntimeEngine(
        path, max_batch=max_batch, providers=providers, threads=threads, runners=runners
    )
    log.info("engine for %s: %s (%s)", path.name, engine.backend, reason)
    return engine
