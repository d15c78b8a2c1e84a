"""The `Engine` protocol every backend implements, the optional capabilities some engines
declare beside it, and what a predictor tells an engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from kiln.app.core.errors import KilnError

# Runs on the engine's device after the host batch is copied there: (xp, array) -> array.
# `xp` is NumPy for CPU engines and CuPy for GPU ones, so preprocessing is written once.
Prepare = Callable[[ModuleType, Any], Any]


@dataclass(frozen=True)
class Choice:
    """The backend chosen for an engine, and why (logged, stored, shown by the API)."""

    backend: str  # one of select.BACKENDS but "auto"
    reason: str

    @property
    def on_gpu(self) -> bool:
        return self.backend != "onnxruntime-cpu"


class BackendUnavailableError(KilnError):
    """The configured backend cannot run here; the message says why."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str | None, ...]
    dtype: str


@dataclass(frozen=True)
class EngineRequest:
    """What a predictor needs built: the ONNX file and how big a batch may be."""

    name: str  # the model's name (and version), for logs and the engine cache
    onnx_path: Any  # pathlib.Path
    max_batch: int
    # Dynamic axes besides the batch, as (axis, min, opt, max): a text model's sequence length.
    # Engines that compile for fixed shapes (TensorRT) need their ranges ahead of time.
    axes: tuple[tuple[int, int, int, int], ...] = ()
    # An image model's normalisation (uint8_input.Normalization): a GPU engine given one takes
    # uint8 NHWC pixels and normalises them itself (its `inputs` then say uint8).
    normalization: Any = None


class Engine(Protocol):
    """Runs one model on whole batches; `infer` is called from the Batcher's runner threads,
    possibly several at once."""

    backend: str  # e.g. "tensorrt:fp16", "onnxruntime:CPUExecutionProvider"
    reason: str  # why this backend was chosen, in a sentence
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch: int

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        """One batch: host arrays in, host arrays out (one leading row per input row).

        `prepare[name]`, when given, transforms that feed where the engine keeps it — on the
        GPU for a GPU engine — e.g. uint8 NHWC pixels into normalised float32 NCHW.
        """
        ...


# --- optional capabilities: what an engine may do beyond `infer` (checked with isinstance)


@runtime_checkable
class HostStaging(Protocol):
    """An engine that stages each runner thread's batches in host buffers of its own (the
    torch engine: pinned on CUDA). Image predictors gather a batch's pixels straight into one
    (`ImageModelPredictor.pixel_buffer`), so the engine does not copy them again."""

    def host_buffer(self, shape: Sequence[int], dtype: str = "uint8") -> np.ndarray:
        """This runner thread's buffer for the first input, `shape` and `dtype`, as NumPy."""
        ...


@runtime_checkable
class Closable(Protocol):
    """An engine that holds device memory to give back before it is dropped (the torch
    engine's CUDA graphs and module). Predictors call it from their own `close`."""

    def close(self) -> None: ...


@runtime_checkable
class MemoryAccount(Protocol):
    """An engine that counts what it holds on its device (the torch and TensorRT engines). The
    memory budget (`runners.memory.engine_bytes`) takes it over the ONNX file's size."""

    memory_bytes: int


def prepared(
    feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None
) -> dict[str, np.ndarray]:
    """Apply `prepare` on the host with NumPy: what CPU engines do."""
    steps = prepare or {}
    return {
        name: np.ascontiguousarray(steps[name](np, x) if name in steps else x)
        for name, x in feeds.items()
    }
