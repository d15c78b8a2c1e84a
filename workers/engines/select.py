"""Choose engine backends for this host, say why, and build each model's engine with the best
one that can build it.

`auto` ranks what this host could run — TensorRT when `tensorrt` imports and a CUDA device is
visible, ONNX Runtime's CUDA provider, PyTorch on CUDA, ONNX Runtime on the CPU — and each model
gets the first that builds it: a model TensorRT cannot build (an unsupported op, output shapes
that depend on the data) falls back to the next, with the reason kept. A failed build is
remembered per model version and backend (`failures.BuildFailures`), so it is retried with
backoff, not on every chunk. The probe is a value, so the rules are tested without a GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnxruntime as ort

from kiln.app.core.errors import TransientError
from kiln.workers.engines.base import BackendUnavailableError, Choice, Engine, EngineRequest
from kiln.workers.engines.failures import BuildFailures
from kiln.workers.engines.onnx_uint8 import engine_onnx, for_engine
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.tensorrt_logic import EngineBuildError
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.ops.device import Gpu, list_gpus

if TYPE_CHECKING:
    from kiln.app.core.config import Settings
    from kiln.app.storage import ObjectStore

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tensorrt", "onnxruntime-cuda", "torch-cuda", "onnxruntime-cpu")
GPU_RUNNERS = 2  # two batches in flight: one copies while the other computes


@dataclass(frozen=True)
class Host:
    """What this process could run on. `probe()` reads it without creating a CUDA context."""

    tensorrt: bool
    gpus: tuple[Gpu, ...]
    ort_providers: tuple[str, ...]
    cpus: int
    torch_cuda: bool = False  # torch imports and sees CUDA (probed only when a GPU is visible)

    @classmethod
    def probe(cls) -> Host:
        gpus = tuple(list_gpus())
        return cls(
            tensorrt=_tensorrt_importable(),
            gpus=gpus,
            ort_providers=tuple(ort.get_available_providers()),
            cpus=os.cpu_count() or 1,
            torch_cuda=bool(gpus) and _torch_cuda(),
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


def _torch_cuda() -> bool:
    """torch sees CUDA and onnx2fx (ONNX → torch) is there: the PyTorch backend can run."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnx2fx") is None:
        return False
    try:
        import torch
    except Exception as error:  # a broken install is "not available"
        log.warning("torch is installed but does not import: %s", error)
        return False
    return bool(torch.cuda.is_available())


def candidates(host: Host, preference: str = "auto") -> list[Choice]:
    """The backends a model may be built with, best first: every one this host could run for
    `auto`, else just the one configured (which must be possible here)."""
    if preference != "auto":
        return [choose(host, preference)]
    gpu = f"{len(host.gpus)} GPU(s) visible ({', '.join(g.name for g in host.gpus)})"
    found = []
    if host.tensorrt and host.gpus:
        found.append(Choice("tensorrt", f"tensorrt imports and {gpu}"))
    if "CUDAExecutionProvider" in host.ort_providers and host.gpus:
        why = "tensorrt is not installed" if not host.tensorrt else "after tensorrt"
        found.append(
            Choice("onnxruntime-cuda", f"{why}; ONNX Runtime has the CUDA provider and {gpu}")
        )
    if host.torch_cuda and host.gpus:
        found.append(Choice("torch-cuda", f"torch sees CUDA and {gpu}"))
    last = Choice("onnxruntime-cpu", "the last resort: ONNX Runtime on the CPU")
    found.append(last if found else choose(host))
    return found


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
    if preference in ("auto", "torch-cuda") and host.torch_cuda and host.gpus:
        return Choice("torch-cuda", f"torch sees CUDA and {gpu}")
    if preference == "torch-cuda":
        missing = "no GPU is visible" if host.torch_cuda else "torch does not see CUDA"
        raise BackendUnavailableError(f"PyTorch CUDA was asked for, but {missing}.")
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


# Builds one model's engine with one backend; raises with a sentence when it cannot.
Builder = Callable[[EngineRequest, Choice], Engine]


@dataclass(frozen=True)
class Built:
    """One engine a factory built, for reports and the memory budget."""

    name: str
    engine: Engine
    onnx_path: Path


class EngineFactory:
    """Builds the engines of one worker process: each with the best backend that builds it.

    `choice` is the host's best backend (it sizes runner threads and OCR's batches); a model
    whose build fails with it gets the next one. `scoped()` gives a view that records the
    engines one model's predictor builds (`built`), sharing everything else.
    """

    def __init__(
        self,
        settings: Settings,
        store: ObjectStore,
        host: Host | None = None,
        builders: Mapping[str, Builder] | None = None,
        failures: BuildFailures | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        standin = settings.device_standin  # benches and tests: workers/engines/standin.py
        self.host = host or (_standin_host(standin) if standin else Host.probe())
        self.candidates = (
            [_standin_choice(standin)] if standin else candidates(self.host, settings.engine)
        )
        self.choice = self.candidates[0]
        self.runners = runner_count(settings.runners, self.choice, self.host)
        self.failures = failures or BuildFailures(settings.engine_retry_s)
        self.builders: Mapping[str, Builder] = builders or {
            "tensorrt": self._tensorrt,
            "onnxruntime-cuda": self._onnxruntime,
            "torch-cuda": self._torch,
            "onnxruntime-cpu": self._onnxruntime,
            "standin": self._standin,
        }
        self.built: list[Built] = []
        log.info("engine backends %s (%s), %d runner(s) per model",
                 ", ".join(c.backend for c in self.candidates), self.choice.reason,
                 self.runners)  # fmt: skip

    @property
    def batch_cap(self) -> int:
        """The largest batch engines are built for here (`KILN_MAX_BATCH`, or under auto what
        a GPU's sweep may choose, or the CPU's knee)."""
        return self.settings.batch_cap(self.choice.on_gpu)

    def scoped(self) -> EngineFactory:
        """The same factory, recording into its own `built` (one model's load)."""
        view = copy.copy(self)
        view.built = []
        return view

    def build(
        self,
        name: str,
        onnx_path: Path,
        max_batch: int,
        axes: tuple[tuple[int, int, int, int], ...] = (),
        normalization: Normalization | None = None,
    ) -> Engine:
        """The engine for `name` (a model version) with the first backend that builds it.
        `normalization`: an image model's, which GPU engines take over (uint8 input)."""
        request = EngineRequest(name, onnx_path, max_batch, axes, normalization)
        passed: list[str] = []  # why better backends were not used, for the report
        for choice in self.candidates:
            held = self.failures.waiting(name, choice.backend)
            if held is not None:
                left = self.failures.seconds_left(held)
                passed.append(f"{choice.backend} failed ({held.reason}; next try in {left:.0f} s)")
                continue
            try:
                engine = self.builders[choice.backend](request, choice)
            except TransientError:
                raise  # a store or database hiccup says nothing about the backend
            except Exception as error:
                failure = self.failures.record(name, choice.backend, _sentence(error))
                log.warning("engine for %s: %s failed to build (attempt %d): %s", name,
                            choice.backend, failure.attempts, failure.reason)  # fmt: skip
                passed.append(f"{choice.backend} failed ({failure.reason})")
                continue
            self.failures.forget(name, choice.backend)
            if passed:
                engine.reason = f"{engine.reason}; fell back: {'; '.join(passed)}"
            self.built.append(Built(name, engine, onnx_path))
            log.info("engine for %s: %s (%s)", name, engine.backend, engine.reason)
            return engine
        raise EngineBuildError(f"No engine backend could build {name}: {'; '.join(passed)}.")

    def _tensorrt(self, request: EngineRequest, choice: Choice) -> Engine:
        from kiln.workers.engines.tensorrt import build_tensorrt_engine

        gpu = self.host.gpus[0]
        # The prepended file: TensorRT's plan key is its sha256, so the plan follows the norm.
        request = for_engine(request, True, self._uint8_dir(request))
        return build_tensorrt_engine(request, self.settings, self.store, gpu, self.runners, choice)

    def _onnxruntime(self, request: EngineRequest, choice: Choice) -> Engine:
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if choice.on_gpu else None
        # On the GPU the graph normalises uint8 pixels itself; the CPU keeps the float graph.
        path = engine_onnx(request, choice.on_gpu, self._uint8_dir(request))
        return OnnxRuntimeEngine(
            path,
            max_batch=request.max_batch,
            providers=providers,
            threads=self.settings.engine_threads,
            runners=self.runners,
            reason=choice.reason,
        )

    def _uint8_dir(self, request: EngineRequest) -> Path:
        """Where prepended (uint8-input) ONNX files go: beside the cached models, else beside
        the model itself."""
        return self.settings.model_cache_dir or Path(request.onnx_path).parent

    def _torch(self, request: EngineRequest, choice: Choice) -> Engine:
        from kiln.workers.engines.torch_engine import build_torch_engine

        return build_torch_engine(
            request, "cuda", self.runners, choice.reason, self.settings.precision,
            graphs=self.settings.cuda_graphs,
        )  # fmt: skip

    def _standin(self, request: EngineRequest, choice: Choice) -> Engine:
        from kiln.workers.engines import standin

        name, report = self.settings.device_standin, self.settings.device_standin_report
        assert name is not None  # the only way this builder is chosen
        return standin.build(request, name, report)


def _standin_host(name: str) -> Host:
    """The host as the device stand-in shows it: its one GPU, no other backend."""
    from kiln.workers.engines import standin

    return Host(
        tensorrt=False, gpus=(standin.gpu(name),), ort_providers=(), cpus=os.cpu_count() or 1
    )


def _standin_choice(name: str) -> Choice:
    from kiln.workers.engines import standin

    return standin.choice(name)


def _sentence(error: BaseException) -> str:
    text = str(error).strip().rstrip(".") or type(error).__name__
    return text.splitlines()[0][:300]
