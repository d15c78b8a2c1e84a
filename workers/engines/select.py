"""Choose an engine backend for this host, say why, and build engines with it.

`auto` takes TensorRT when `tensorrt` imports and a CUDA device is visible, else ONNX Runtime's
CUDA provider, else ONNX Runtime on the CPU. The probe is a value, so the rule is tested here
without a GPU.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from kiln.workers.device import Gpu, list_gpus
from kiln.workers.engines.base import BackendUnavailableError, Choice, Engine, EngineRequest
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine

if TYPE_CHECKING:
    from kiln.app.core.config import Settings
    from kiln.app.storage import ObjectStore

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tensorrt", "onnxruntime-cuda", "onnxruntime-cpu")
GPU_RUNNERS = 2  # two batches in flight: one copies while the other computes


@dataclass(frozen=True)
class Host:
    """What this process could run on. `probe()` reads it without creating a CUDA context."""

    tensorrt: bool
    gpus: tuple[Gpu, ...]
    ort_providers: tuple[str, ...]
    cpus: int

    @classmethod
    def probe(cls) -> Host:
        return cls(
            tensorrt=_tensorrt_importable(),
            gpus=tuple(list_gpus()),
            ort_providers=tuple(ort.get_available_providers()),
            cpus=os.cpu_count() or 1,
        )


def _tensorrt_importable() -> bool:
    """The real library, not a stub-only namespace (tensorrt-stubs ships `tensorrt/*.pyi`,
    which Python finds as a namespace package: no origin, and nothing worth importing)."""
    spec = importlib.util.find_spec("tensorrt")
    if spec is None or spec.origin is None:
        return False
    try:
        import tensorrt
    except Exception as error:  # a broken install (missing libnvinfer) is "not available"
        log.warning("tensorrt is installed but does not import: %s", error)
        return False
    return hasattr(tensorrt, "Builder")


def choose(host: Host, preference: str = "auto") -> Choice:
    if preference not in BACKENDS:
        raise ValueError(f"Unknown engine backend {preference!r}; use one of {BACKENDS}.")
    cuda_ort = "CUDAExecutionProvider" in host.ort_providers
    gpu = f"{len(host.gpus)} GPU(s) visible ({', '.join(g.name for g in host.gpus)})"
    if preference in ("auto", "tensorrt") and host.tensorrt and host.gpus:
        return Choice("tensorrt", f"tensorrt imports and {gpu}")
    if preference == "tensorrt":
        missing = "no GPU is visible" if host.tensorrt else "the tensorrt package is not installed"
        raise BackendUnavailableError(f"TensorRT was asked for, but {missing}.")
    if preference in ("auto", "onnxruntime-cuda") and cuda_ort and host.gpus:
        why = "tensorrt is not installed" if not host.tensorrt else "tensorrt unusable"
        return Choice("onnxruntime-cuda", f"{why}; ONNX Runtime has the CUDA provider and {gpu}")
    if preference == "onnxruntime-cuda":
        missing = "no GPU is visible" if cuda_ort else "onnxruntime-gpu is not installed"
        raise BackendUnavailableError(f"ONNX Runtime CUDA was asked for, but {missing}.")
    if preference == "onnxruntime-cpu":
        return Choice("onnxruntime-cpu", "configured (KILN_ENGINE=onnxruntime-cpu)")
    return Choice(
        "onnxruntime-cpu", "no GPU is visible" if not host.gpus else "no GPU backend installed"
    )


def runner_count(configured: int, choice: Choice, host: Host) -> int:
    """Runner threads per model: as configured; else on a GPU two (the next batch's copy
    overlaps the current compute), on a CPU one per core, each with one intra-op thread so no
    straggler half of a split stalls a batch (docs/architecture.md, "Engines and devices")."""
    if configured:
        return configured
    return GPU_RUNNERS if choice.on_gpu else host.cpus


class EngineFactory:
    """Builds every engine of one worker process, all with the same backend choice."""

    def __init__(self, settings: Settings, store: ObjectStore, host: Host | None = None) -> None:
        self.settings = settings
        self.store = store
        self.host = host or Host.probe()
        self.choice = choose(self.host, settings.engine)
        self.runners = runner_count(settings.runners, self.choice, self.host)
        log.info("engine backend %s (%s), %d runner(s) per model", self.choice.backend,
                 self.choice.reason, self.runners)  # fmt: skip

    def build(
        self,
        name: str,
        onnx_path: Path,
        max_batch: int,
        axes: tuple[tuple[int, int, int, int], ...] = (),
    ) -> Engine:
        request = EngineRequest(name, onnx_path, max_batch, axes)
        if self.choice.backend == "tensorrt":
            from kiln.workers.engines.tensorrt import build_tensorrt_engine

            engine: Engine = build_tensorrt_engine(
                request, self.settings, self.store, self.host.gpus[0], self.runners, self.choice
            )
        else:
            providers = (
                ["CUDAExecutionProvider", "CPUExecutionProvider"] if self.choice.on_gpu else None
            )
            engine = OnnxRuntimeEngine(
                onnx_path,
                max_batch=max_batch,
                providers=providers,
                threads=self.settings.engine_threads,
                runners=self.runners,
                reason=self.choice.reason,
            )
        log.info("engine for %s: %s (%s)", name, engine.backend, engine.reason)
        return engine
