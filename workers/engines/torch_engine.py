"""PyTorch engine: the ONNX graph converted to torch by onnx2fx, run on CUDA the way the GPU
wants it, or on the CPU (where the tests run the same logic).

On CUDA (docs/gpu.md has the measurements behind each choice):
- FP16 weights (`module.half()`) and channels_last for a fixed-shape image model, under autocast
  so the ops PyTorch keeps in FP32 (softmax, norms, reductions) stay there; a model whose FP16
  forward fails or is not finite keeps FP32 weights under autocast, as dynamic-shape models do.
- Image models take uint8 NHWC pixels (the prep processes' slots, `uint8_input`): staged in a
  pinned buffer reused per runner thread, copied without blocking on that thread's stream
  (`torch_transfers`), and normalised on the device; NHWC memory permuted to NCHW *is*
  channels_last, so no transpose.
- A fixed-shape model replays CUDA graphs, one per batch bucket (`cuda_graphs`); dynamic-shape
  ones (OCR's detector, text) run eagerly. `graphs=False` turns graphs off.
- Outputs come back through pinned buffers without blocking; one synchronisation per batch.
The converted module is not cached on disk: onnx2fx's graphs call functions local to its
converters, which neither torch.save nor cloudpickle can write (conversion takes under a
second for ResNet-50: docs/gpu.md).

For a GPU host with torch but neither TensorRT nor ONNX Runtime's CUDA provider. `torch`,
`onnx2fx` and `cupy` are imported inside functions, so this module imports without them and a
worker (or test) process that never builds this engine stays torch-free. Why onnx2fx and not
onnx2torch: onnx2torch imports torchvision at import time (PyPI's wheel needs CUDA torch), and
converts none of the PP-OCR graphs nor the text embedder (`GreaterOrEqual`).
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.workers.engines.base import (
    BackendUnavailableError,
    EngineRequest,
    Prepare,
    TensorSpec,
)
from kiln.workers.engines.cuda_graphs import (
    Capture,
    Captured,
    Graphs,
    GraphSet,
    bucket_for,
    cuda_capture,
    cuda_pool,
)
from kiln.workers.engines.tensorrt_logic import (
    Precision,
    PrecisionSetting,
    check_names,
    decide_precision,
)
from kiln.workers.engines.torch_transfers import Transfers
from kiln.workers.engines.uint8_input import Normalization, TorchNormalization

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

FAST_FP16 = (7, 0)  # compute capability with tensor cores (Volta): FP16 is worth it from here
PROBE_ROWS = 2  # the FP16 forward checked at build on this many rows


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


def fixed_shape(inputs: Sequence[TensorSpec]) -> bool:
    """Every side but the batch is known: what a CUDA graph per batch bucket needs."""
    return all(isinstance(d, int) and d > 0 for s in inputs for d in s.shape[1:])


def uint8_input(spec: TensorSpec, norm: Normalization) -> TensorSpec:
    """The uint8 NHWC input an image model takes instead of its float one."""
    if len(spec.shape) != 4 or spec.dtype not in ("float32", "float16"):
        raise ValueError(
            f"Input {spec.name} is {spec.dtype} {spec.shape}: not a float image batch to take "
            "as uint8 pixels."
        )
    height, width = (spec.shape[2:4]) if norm.layout == "NCHW" else spec.shape[1:3]
    return TensorSpec(spec.name, (spec.shape[0], height, width, 3), "uint8")


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


@dataclass(frozen=True)
class Options:
    """How a TorchEngine drives its module (decided by `build_torch_engine`)."""

    device: str
    precision: Precision
    max_batch: int
    normalization: Normalization | None = None
    graphs: bool = True
    runners: int = 1
    half_weights: bool = False
    reason: str = "configured"
    notes: tuple[str, ...] = field(default=())


def build_torch_engine(
    request: EngineRequest,
    device: str | None = None,
    runners: int = 1,
    reason: str = "",
    precision: PrecisionSetting = "auto",
    *,
    graphs: bool = True,
) -> TorchEngine:
    """The engine for `request` on `device` (`cuda`, `cpu`, or None: CUDA when torch sees it).
    `graphs`: replay CUDA graphs for a fixed-shape model."""
    torch, onnx2fx = require_torch()
    import onnx

    where = decide_device(device, torch.cuda.is_available())
    capability = torch.cuda.get_device_capability() if where == "cuda" else None
    model = onnx.load(str(request.onnx_path))
    inputs, outputs = graph_specs(model)
    started = time.perf_counter()
    module = convert(onnx2fx, model, request)
    converted = f"converted in {time.perf_counter() - started:.2f} s"
    if where == "cpu":
        # Process-wide, like ONNX Runtime's per-session share: the cores split between runners.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, runners)))
    chosen = torch_precision(precision, where, capability)
    norm = request.normalization if _takes_images(inputs, request.normalization) else None
    options = Options(
        where, chosen, request.max_batch, norm,
        graphs=graphs and where == "cuda" and fixed_shape(inputs),
        runners=runners,
        half_weights=chosen == "fp16" and fixed_shape(inputs),
        reason=reason or "configured",
        notes=(converted,),
    )  # fmt: skip
    return checked_engine(module, inputs, outputs, options)


def _takes_images(inputs: list[TensorSpec], norm: Normalization | None) -> bool:
    return norm is not None and len(inputs) == 1 and len(inputs[0].shape) == 4


def checked_engine(
    module: Any, inputs: list[TensorSpec], outputs: list[TensorSpec], options: Options
) -> TorchEngine:
    """The engine with FP16 weights when its forward stays finite on a probe batch; else the
    same module with FP32 weights under autocast (what PyTorch's AMP does)."""
    engine = _half_or_full(module, inputs, outputs, options)
    engine.warm()
    return engine


def _half_or_full(
    module: Any, inputs: list[TensorSpec], outputs: list[TensorSpec], options: Options
) -> TorchEngine:
    if not options.half_weights:
        return TorchEngine(module, inputs, outputs, options)
    engine = TorchEngine(copy.deepcopy(module), inputs, outputs, options)
    failure = engine.probe()
    if failure is None:
        return engine
    engine.close()
    log.warning("FP16 weights fail for this model (%s): FP32 weights under autocast", failure)
    kept = replace(options, half_weights=False, notes=(*options.notes, f"FP32 weights: {failure}"))
    return TorchEngine(module, inputs, outputs, kept)


# --- running ------------------------------------------------------------------------------


class TorchEngine:
    """One module shared by the runner threads: forward under inference_mode keeps no state,
    and on CUDA each thread queues its batches on its own stream, with its own host buffers
    and, replaying, a graph set of its own for the length of a batch."""

    def __init__(
        self,
        module: Any,
        inputs: list[TensorSpec],
        outputs: list[TensorSpec],
        options: Options,
        capture: Capture | None = None,
    ) -> None:
        import torch

        self._torch: Any = torch  # Any: torch's typing differs between its releases
        self._device = torch.device(options.device)
        self.device = self._device  # where `infer_tensors` wants its feeds (device_pixels)
        self._cuda = self._device.type == "cuda"
        self._fp16 = options.precision == "fp16"
        _check_inputs(module, inputs)
        self._module = _placed(module, self._device, options.half_weights, len(inputs[0].shape))
        self.memory_bytes = _weights_bytes(self._module)
        self.backend = backend_name(self._device.type, options.precision)
        self.reason = "; ".join((options.reason, *options.notes))
        self.options = options
        self.model_inputs = inputs
        self.inputs = inputs
        self.outputs = outputs
        self.max_batch = options.max_batch
        fed = torch.float16 if options.half_weights else None
        self._normalize: TorchNormalization | None = None
        if options.normalization is not None:
            self.inputs = [uint8_input(inputs[0], options.normalization)]
            dtype = fed or getattr(torch, inputs[0].dtype)
            self._normalize = TorchNormalization(options.normalization, self._device, dtype)
        self._cast_to = fed
        self._transfers = Transfers(torch, self._device)
        self.graphs: Graphs | None = None
        if options.graphs and fixed_shape(self.inputs):
            self.graphs = self._graph_sets(capture or cuda_capture(torch, self._device))
        if self._cuda:
            torch.cuda.synchronize(self._device)  # weights uploaded before any side stream reads

    # --- the Engine protocol

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        check_names([s.name for s in self.inputs], feeds)
        with self._torch.inference_mode(), self.on_stream():
            if prepare:  # a family's own step (OCR): eager, CuPy on the device
                names = [s.name for s in self.inputs]
                devices = self._transfers.uploaded(names, feeds, prepare)
                return self._host(self._forward(devices), _rows(feeds))
            hosts = [self._transfers.held(s.name, feeds[s.name]) for s in self.inputs]
            return self._run(hosts, _rows(feeds))

    def infer_tensors(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """`infer` for feeds already on the device (images decoded and fitted there). Call it
        inside `on_stream()`, where they were made, so no stream reads what another writes."""
        check_names([s.name for s in self.inputs], tensors)
        with self._torch.inference_mode(), self.on_stream():
            ready = [tensors[s.name].to(self._device) for s in self.inputs]
            return self._run(ready, int(ready[0].shape[0]))

    def forward_tensors(self, tensors: Mapping[str, Any]) -> list[Any]:
        """Device feeds → device outputs, queued on the current stream (the device stages'
        forward stage; its outputs stage calls `outputs_to_host`). A replayed graph's outputs
        are copied out of its static buffers, so its set goes back to the next batch at once."""
        check_names([s.name for s in self.inputs], tensors)
        ready = [tensors[s.name] for s in self.inputs]
        rows = int(ready[0].shape[0])
        with self._torch.inference_mode():
            graphs = self.graphs
            if graphs is not None and rows <= graphs.sizes[-1]:
                with graphs.lend() as graph_set:
                    graph = self._graph(graph_set, bucket_for(rows, graphs.sizes))
                    if graph is not None:
                        for static, tensor in zip(graph.inputs, ready, strict=True):
                            static[:rows].copy_(tensor, non_blocking=True)
                        graph.replay()
                        outputs = [value[:rows].clone() for value in graph.outputs]
                        self._queued_on(graph_set)
                        return outputs
            # The stage runs without the device as the default (a Python call on each torch
            # op); the converted code makes tensors of its own, so it gets it (as a capture)
            with self._transfers.on_device():
                return [value[:rows] for value in self._forward(ready)]

    def outputs_to_host(self, values: list[Any], rows: int) -> dict[str, np.ndarray]:
        """`forward_tensors`' outputs on the host: copied on the current stream into this
        thread's pinned buffers, then waited for."""
        return self._host(values, rows)

    def host_buffer(self, shape: Sequence[int], dtype: str = "uint8") -> np.ndarray:
        """This thread's staging buffer for the first input as a NumPy array: a batch gathered
        into it is not copied again before it goes to the device."""
        spec = self.inputs[0]
        staging = self._transfers.staging()
        tensor = staging.take(spec.name, shape, getattr(self._torch, dtype))
        array: np.ndarray = tensor.numpy()
        return array

    def on_stream(self) -> AbstractContextManager[None]:
        """This thread's CUDA stream, and the device as the default for tensors the converted
        code creates itself (shapes, ranges, constants of a shape): they must not land on the
        CPU beside CUDA activations."""
        return self._transfers.on_stream()

    def probe(self) -> str | None:
        """Why this engine's forward is unusable (an error, a non-finite output), or None."""
        generator = np.random.default_rng(0)
        feeds = {
            s.name: generator.integers(0, 256, (PROBE_ROWS, *_known(s))).astype(s.dtype)
            for s in self.inputs
        }
        try:
            with self._torch.inference_mode(), self.on_stream():
                hosts = [self._transfers.held(s.name, feeds[s.name]) for s in self.inputs]
                devices = [h.to(self._device) for h in hosts]
                values = self._forward(devices)
                finite = all(bool(self._torch.isfinite(v).all()) for v in values
                             if v.is_floating_point())  # fmt: skip
        except Exception as error:
            return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return None if finite else "an output is not finite"

    def close(self) -> None:
        """Graphs first (they hold memory from their pools), then the module."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self._module = None

    # --- the forward pass

    def _forward(self, tensors: list[Any]) -> list[Any]:
        """Device inputs → device outputs in the ONNX file's dtypes: what a graph captures."""
        torch = self._torch
        if self._normalize is not None:
            ready = [self._normalize(tensors[0])]
        elif self._cast_to is not None:
            ready = [t.to(self._cast_to) if t.is_floating_point() else t for t in tensors]
        else:
            ready = tensors
        # cache_enabled=False: autocast's weight cache must not be captured into a graph.
        with torch.autocast(self._device.type, dtype=torch.float16, enabled=self._fp16,
                            cache_enabled=False):  # fmt: skip
            result = self._module(*ready)
        values: Sequence[Any] = result if isinstance(result, (tuple, list)) else (result,)
        if len(values) != len(self.outputs):
            raise RuntimeError(
                f"The converted graph gave {len(values)} outputs, the ONNX file declares "
                f"{len(self.outputs)}."
            )
        return [
            v.float() if spec.dtype == "float32" and v.dtype != torch.float32 else v
            for spec, v in zip(self.outputs, values, strict=True)
        ]

    def _run(self, tensors: list[Any], rows: int) -> dict[str, np.ndarray]:
        """One batch from host (staged) or device tensors: replayed when a graph holds it."""
        graphs = self.graphs
        if graphs is not None and rows <= graphs.sizes[-1]:
            with graphs.lend() as graph_set:
                replayed = self._replay(graph_set, tensors, rows)
                if replayed is not None:
                    return replayed
        devices = [t.to(self._device, non_blocking=True) for t in tensors]
        return self._host(self._forward(devices), rows)

    def warm(self) -> None:
        """Capture every bucket's graph of every runner's set now, while the model loads: not
        in a runner thread in the middle of a job."""
        graphs = self.graphs
        if graphs is None:
            return
        started = time.perf_counter()
        with self._torch.inference_mode(), self.on_stream():
            for graph_set in graphs.sets:
                for bucket in graphs.sizes:
                    if self._graph(graph_set, bucket) is None:
                        return
        seconds = time.perf_counter() - started
        self.reason += f"; {len(graphs.sizes)} CUDA graphs per runner captured in {seconds:.1f} s"

    def _graph(self, graph_set: GraphSet, bucket: int) -> Captured | None:
        """The bucket's graph, once this thread's stream has waited for the set's last queued
        use; None if it cannot be captured (graphs are then off for this engine, and the
        reason kept)."""
        try:
            graph = graph_set.get(bucket)
        except Exception as error:  # a converted op that cannot be captured: eager from now on
            log.warning("CUDA graph capture failed, running eagerly: %s", error)
            self.reason += f"; CUDA graphs off: {str(error).splitlines()[0][:200]}"
            graphs, self.graphs = self.graphs, None
            if graphs is not None:
                graphs.close()
            return None
        self._after_last_use(graph_set)
        return graph

    def _queued_on(self, graph_set: GraphSet) -> None:
        """The set goes back before its replay and copies have run (a staged forward): its
        next borrower's stream waits for them (`_after_last_use`)."""
        if self._cuda:
            graph_set.released = self._torch.cuda.current_stream(self._device).record_event()

    def _after_last_use(self, graph_set: GraphSet) -> None:
        """This thread's stream waits for the set's last queued use before it writes the
        static inputs (on the same stream, the order is already so)."""
        if graph_set.released is not None:
            self._torch.cuda.current_stream(self._device).wait_event(graph_set.released)

    def _replay(
        self, graph_set: GraphSet, tensors: list[Any], rows: int
    ) -> dict[str, np.ndarray] | None:
        """The batch through its bucket's graph, padded; None if there is no graph."""
        sizes = self.graphs.sizes if self.graphs is not None else [rows]
        graph = self._graph(graph_set, bucket_for(rows, sizes))
        if graph is None:
            return None
        for static, tensor in zip(graph.inputs, tensors, strict=True):
            static[:rows].copy_(tensor, non_blocking=True)
        graph.replay()
        return self._host(graph.outputs, rows)  # still inside the lend: outputs are static

    def _graph_sets(self, capture: Capture) -> Graphs:
        torch = self._torch

        def statics(rows: int) -> list[Any]:
            return [
                torch.zeros((rows, *s.shape[1:]), dtype=getattr(torch, s.dtype),
                            device=self._device)
                for s in self.inputs
            ]  # fmt: skip

        def forward(tensors: list[Any]) -> list[Any]:
            # The device as the default, but no stream of our own: capture records the stream
            # it set up, and a switch to the runner's stream would leave the graph empty.
            with torch.inference_mode(), self._transfers.on_device():
                return self._forward(tensors)

        pools = [cuda_pool(torch) if self._cuda else None for _ in range(self.options.runners)]
        sets = [GraphSet(capture, forward, statics, pool) for pool in pools]
        return Graphs(sets, self.max_batch)

    def _host(self, values: list[Any], rows: int) -> dict[str, np.ndarray]:
        """The first `rows` rows of each output, by the ONNX file's names, on the host."""
        return self._transfers.to_host([s.name for s in self.outputs], values, rows)


def _check_inputs(module: Any, inputs: Sequence[TensorSpec]) -> None:
    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise BackendUnavailableError(
            f"The converted graph takes {len(placeholders)} inputs, "
            f"the ONNX file declares {len(inputs)}."
        )


def _weights_bytes(module: Any) -> int:
    """For the memory budget: the weights as they sit on the device (activations are not
    counted; the budget's headroom is for them)."""
    tensors = [*module.parameters(), *module.buffers()]
    return int(sum(t.numel() * t.element_size() for t in tensors))


def _placed(module: Any, device: Any, half: bool, rank: int) -> Any:
    """The module on `device`, in inference mode; FP16 weights when asked; channels_last for
    an image model (its 4-D weights), which is how the uint8 NHWC batch arrives."""
    import torch

    placed = module.to(device).eval()
    if half:
        placed = placed.half()
    if rank == 4:
        placed = placed.to(memory_format=torch.channels_last)
    return placed


def _known(spec: TensorSpec) -> tuple[int, ...]:
    """The input's sides past the batch (the probe runs fixed-shape models only)."""
    return tuple(d if isinstance(d, int) else 1 for d in spec.shape[1:])


def _rows(feeds: Mapping[str, np.ndarray]) -> int:
    return int(next(iter(feeds.values())).shape[0])
