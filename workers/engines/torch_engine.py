"""PyTorch engine: the ONNX graph converted to torch by onnx2fx, run on CUDA (FP16 under
autocast where the GPU has tensor cores) or on the CPU.

For a GPU host with torch but neither TensorRT nor ONNX Runtime's CUDA provider. `torch`,
`onnx2fx` and `cupy` are imported inside functions, so this module imports without them and a
worker (or test) process that never builds this engine stays torch-free. Why onnx2fx and not
onnx2torch: onnx2torch imports torchvision at import time (PyPI's wheel needs CUDA torch), and
converts none of the PP-OCR graphs nor the text embedder (`GreaterOrEqual`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.workers.engines.base import (
    BackendUnavailableError,
    EngineRequest,
    Prepare,
    TensorSpec,
    prepared,
)
from kiln.workers.engines.tensorrt_logic import (
    Precision,
    PrecisionSetting,
    check_names,
    decide_precision,
)

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

FAST_FP16 = (7, 0)  # compute capability with tensor cores (Volta): FP16 is worth it from here


# --- pure decisions (tested without torch) ------------------------------------------------


def decide_device(requested: str | None, cuda_available: bool) -> str:
    """`cuda` when asked for or, unasked, when torch sees CUDA; else `cpu`."""
    if requested in (None, "auto"):
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise BackendUnavailableError("The torch backend was asked for CUDA, but torch sees none.")
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"Unknown torch device {requested!r}; use cuda or cpu.")
    return requested


def torch_precision(
    setting: PrecisionSetting, device: str, capability: tuple[int, int] | None
) -> Precision:
    """FP16 only on CUDA: `auto` where the GPU has tensor cores, `fp16` wherever asked. On
    the CPU always FP32 (FP16 there is slower, not faster)."""
    if device != "cuda":
        return "fp32"
    return decide_precision(setting, capability is not None and capability >= FAST_FP16)


def backend_name(device: str, precision: Precision) -> str:
    return f"torch:{device}:fp16" if precision == "fp16" else f"torch:{device}"


def graph_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The graph's real inputs (old IRs list initializers as inputs too) and outputs."""
    weights = {t.name for t in model.graph.initializer}
    inputs = [_spec(v) for v in model.graph.input if v.name not in weights]
    return inputs, [_spec(v) for v in model.graph.output]


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    import onnx

    tensor = value.type.tensor_type
    shape = tuple(
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim
    )
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type).name
    return TensorSpec(value.name, shape, dtype)


# --- building -----------------------------------------------------------------------------


def require_torch() -> tuple[ModuleType, ModuleType]:
    """torch and onnx2fx, or a sentence saying which is missing."""
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("The torch package is not installed.") from None
    try:
        import onnx2fx
    except ImportError:
        raise BackendUnavailableError(
            "The onnx2fx package (ONNX → torch) is not installed."
        ) from None
    return torch, onnx2fx


def convert(onnx2fx: ModuleType, model: onnx.ModelProto, request: EngineRequest) -> Any:
    """The graph as a torch.fx.GraphModule; an op onnx2fx lacks is named in the error."""
    try:
        return onnx2fx.convert(model, base_dir=str(Path(request.onnx_path).parent))
    except onnx2fx.UnsupportedOpError as error:
        domain = f" (domain {error.domain})" if error.domain else ""
        raise BackendUnavailableError(
            f"onnx2fx cannot convert {request.name}: the ONNX operator {error.op_type}{domain} "
            f"is not supported at opset {error.opset_version}."
        ) from None
    except Exception as error:  # a converter bug is "this backend cannot run it", not a crash
        raise BackendUnavailableError(
            f"onnx2fx failed to convert {request.name}: {error}"
        ) from None


def build_torch_engine(
    request: EngineRequest,
    device: str | None = None,
    runners: int = 1,
    reason: str = "",
    precision: PrecisionSetting = "auto",
) -> TorchEngine:
    """The engine for `request` on `device` (`cuda`, `cpu`, or None: CUDA when torch sees it)."""
    torch, onnx2fx = require_torch()
    import onnx

    where = decide_device(device, torch.cuda.is_available())
    capability = torch.cuda.get_device_capability() if where == "cuda" else None
    model = onnx.load(str(request.onnx_path))
    inputs, outputs = graph_specs(model)
    module = convert(onnx2fx, model, request)
    if where == "cpu":
        # Process-wide, like ONNX Runtime's per-session share: the cores split between runners.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, runners)))
    return TorchEngine(
        module,
        device=where,
        precision=torch_precision(precision, where, capability),
        inputs=inputs,
        outputs=outputs,
        max_batch=request.max_batch,
        reason=reason or "configured",
    )


# --- running ------------------------------------------------------------------------------


class TorchEngine:
    """One module shared by the runner threads: forward under inference_mode keeps no state,
    and on CUDA each thread queues its batches on its own stream."""

    def __init__(
        self,
        module: Any,
        *,
        device: str,
        precision: Precision,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        max_batch: int,
        reason: str,
    ) -> None:
        import torch

        self._torch: Any = torch  # Any: torch's typing differs between its releases
        self._device = torch.device(device)
        self.device = self._device  # where `infer_tensors` wants its feeds (device_images)
        self._fp16 = precision == "fp16"
        self._module = module.to(self._device).eval()
        # For the memory budget: the weights as they sit on the device (activations are not
        # counted; the budget's headroom is for them).
        tensors = [*self._module.parameters(), *self._module.buffers()]
        self.memory_bytes = int(sum(t.numel() * t.element_size() for t in tensors))
        placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise BackendUnavailableError(
                f"The converted graph takes {len(placeholders)} inputs, "
                f"the ONNX file declares {len(inputs)}."
            )
        self.backend = backend_name(self._device.type, precision)
        self.reason = reason
        self.inputs = inputs
        self.outputs = outputs
        self.max_batch = max_batch
        self._cupy = _cupy() if self._device.type == "cuda" else None
        self._local = threading.local()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # weights uploaded before any side stream reads

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        check_names([s.name for s in self.inputs], feeds)
        with self._torch.inference_mode(), self._on_device():
            tensors = self._stage(feeds, prepare or {})
            half = self._torch.float16
            with self._torch.autocast(self._device.type, dtype=half, enabled=self._fp16):
                result = self._module(*tensors)
            return self._collect(result)

    def infer_tensors(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """`infer` for feeds already made as torch tensors (images decoded and normalised on
        the device): no `prepare`, no host copy. This thread's stream first waits for the
        stream that made them, so it never reads pixels still being written."""
        check_names([s.name for s in self.inputs], tensors)
        with self._torch.inference_mode():
            cuda = self._device.type == "cuda"
            producer = self._torch.cuda.current_stream(self._device) if cuda else None
            with self._on_device():
                if producer is not None:
                    self._torch.cuda.current_stream(self._device).wait_stream(producer)
                ready = [tensors[s.name].to(self._device) for s in self.inputs]
                half = self._torch.float16
                with self._torch.autocast(self._device.type, dtype=half, enabled=self._fp16):
                    result = self._module(*ready)
                return self._collect(result)

    @contextlib.contextmanager
    def _on_device(self) -> Iterator[None]:
        """This thread's CUDA stream, and the device as the default for tensors the converted
        code creates itself (shapes, ranges, constants of a shape): they must not land on the
        CPU beside CUDA activations."""
        if self._device.type != "cuda":
            yield  # on the CPU everything is already where it must be
            return
        with self._device, self._torch.cuda.stream(self._stream()):
            yield

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._torch.cuda.Stream(device=self._device)
        return stream

    def _stage(self, feeds: Mapping[str, np.ndarray], steps: Mapping[str, Prepare]) -> list[Any]:
        """Feeds in the graph's input order, on the device, each after its `prepare`: on the
        GPU with CuPy when it imports, else on the host with NumPy (then the prepared array
        is what crosses the bus, e.g. float32 instead of uint8 pixels)."""
        if self._cupy is None:
            ready = prepared(feeds, steps)
            return [self._upload(ready[s.name]) for s in self.inputs]
        tensors = []
        for spec in self.inputs:
            raw = self._upload(np.ascontiguousarray(feeds[spec.name]))
            step = steps.get(spec.name)
            tensors.append(raw if step is None else self._prepare_on_gpu(raw, step))
        return tensors

    def _upload(self, array: np.ndarray) -> Any:
        if not array.flags.writeable:  # torch shares NumPy memory and warns on read-only arrays
            array = array.copy()
        return self._torch.from_numpy(array).to(self._device)

    def _prepare_on_gpu(self, raw: Any, step: Prepare) -> Any:
        """CuPy sees the tensor's memory through DLPack, on this thread's torch stream."""
        cp = self._cupy
        assert cp is not None
        with self._cupy_stream():
            ready = cp.ascontiguousarray(step(cp, cp.from_dlpack(raw)))
            return self._torch.from_dlpack(ready)

    def _cupy_stream(self) -> Any:
        """This thread's torch stream as CuPy sees it, made once per runner thread. CuPy 14
        deprecates `ExternalStream` (for a `Stream.from_external` that takes a stream
        object): only that warning is silenced, once per thread, not per batch."""
        wrapped = getattr(self._local, "cupy_stream", None)
        if wrapped is None:
            cp = self._cupy
            assert cp is not None
            handle = self._torch.cuda.current_stream(self._device).cuda_stream
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", "ExternalStream is deprecated", DeprecationWarning
                )
                wrapped = self._local.cupy_stream = cp.cuda.ExternalStream(handle)
        return wrapped

    def _collect(self, result: Any) -> dict[str, np.ndarray]:
        """Host arrays in the ONNX file's dtypes: FP32 outputs come back FP32 under autocast."""
        values: Sequence[Any] = result if isinstance(result, (tuple, list)) else (result,)
        if len(values) != len(self.outputs):
            raise RuntimeError(
                f"The converted graph gave {len(values)} outputs, the ONNX file declares "
                f"{len(self.outputs)}."
            )
        arrays = {}
        for spec, value in zip(self.outputs, values, strict=True):
            tensor = value.float() if spec.dtype == "float32" else value
            arrays[spec.name] = tensor.cpu().numpy()  # a blocking copy: waits for the stream
        return arrays


def _cupy() -> ModuleType | None:
    try:
        import cupy
    except ImportError:
        log.info("cupy is not installed: the torch engine applies `prepare` on the host")
        return None
    module: ModuleType = cupy
    return module
