"""Choose an engine backend for this host, and say why."""

from __future__ import annotations

import logging
import os
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


def runner_count(configured: int = 0) -> int:
    """Runner threads per model: as configured, else one per core on CPU (each with one
    intra-op thread: no straggler half of a split stalls a batch, see DESIGN.md) and one on a
    GPU (copies overlap compute inside it)."""
    if configured:
        return configured
    providers, _reason = choose_providers()
    return 1 if "CUDAExecutionProvider" in providers else (os.cpu_count() or 1)


def build_engine(
    path: Path, *, max_batch: int, threads: int = 0, runners: int = 1, backend: str = "auto"
) -> Engine:
    providers, reason = choose_providers(backend)
    engine = OnnxRuntimeEngine(
        path, max_batch=max_batch, providers=providers, threads=threads, runners=runners
    )
    log.info("engine for %s: %s (%s)", path.name, engine.backend, reason)
    return engine
