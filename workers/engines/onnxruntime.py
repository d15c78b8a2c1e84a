"""ONNX Runtime engine: the CPU path tests and CPU hosts run, and the CUDA provider on a GPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from kiln.workers.engines.base import Prepare, TensorSpec, prepared

log = logging.getLogger(__name__)

_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(uint8)": "uint8",
}


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning intra-op threads steal the cores that decode images (docs/architecture.md).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def default_threads(runners: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, runners))


class OnnxRuntimeEngine:
    """One session shared by the runner threads (`run` is thread-safe)."""

    def __init__(
        self,
        path: Path,
        *,
        max_batch: int,
        providers: list[str] | None = None,
        threads: int = 0,
        runners: int = 1,
        reason: str = "",
    ) -> None:
        providers = providers or ["CPUExecutionProvider"]
        if "CUDAExecutionProvider" in providers:
            _preload_cuda()
        options = session_options(threads or default_threads(runners))
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        self.backend = f"onnxruntime:{self.session.get_providers()[0]}"
        self.reason = reason or "configured"
        self.max_batch = max_batch
        self.inputs = [_spec(i) for i in self.session.get_inputs()]
        self.outputs = [_spec(o) for o in self.session.get_outputs()]
        self._output_names = [o.name for o in self.outputs]

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        results = self.session.run(self._output_names, prepared(feeds, prepare))
        return dict(zip(self._output_names, results, strict=True))


def _preload_cuda() -> None:
    """Load the CUDA and cuDNN libraries from the `nvidia-*` wheels (`kiln[gpu-libs]`), which
    the dynamic loader does not search; without them the CUDA provider silently falls back to
    the CPU. A no-op where the host has them, and before ONNX Runtime 1.21 (no preload)."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload()
    except Exception as error:  # the host's own libraries may still do: the session will say
        log.warning("onnxruntime.preload_dlls failed: %s", error)


def _spec(node: ort.NodeArg) -> TensorSpec:
    return TensorSpec(node.name, tuple(node.shape), _DTYPES.get(node.type, node.type))
