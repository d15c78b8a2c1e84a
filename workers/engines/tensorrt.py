"""TensorRT engine: ONNX → serialized plan (cached in object storage) → execution contexts.

Built inside the worker process that uses it (after any fork), on the device CUDA sees as 0
(`workers.ops.device.pin`). `tensorrt` and `cupy` are imported inside functions, so this module
imports on hosts without them. The pure parts are in `tensorrt_logic`, the plan cache in
`engine_cache`; both are tested on a CPU, the CUDA calls here only on a GPU (tests/gpu).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.workers.engines.base import (
    BackendUnavailableError,
    Choice,
    EngineRequest,
    Prepare,
    TensorSpec,
)
from kiln.workers.engines.engine_cache import (
    Obtained,
    PlanSpec,
    load_or_build,
    plan_spec,
    read_timing_cache,
    timing_cache_key,
    write_timing_cache,
)
from kiln.workers.engines.tensorrt_logic import (
    ContextPool,
    EngineBuildError,
    Precision,
    PrecisionSetting,
    Shape,
    TensorRange,
    buffer_bytes,
    check_feed,
    check_names,
    concrete_shape,
    engine_max_batch,
    grown,
    numpy_dtype,
    parse_failure,
    python_level,
    volume,
)

if TYPE_CHECKING:
    import tensorrt as trt

    from kiln.app.core.config import Settings
    from kiln.app.storage import ObjectStore
    from kiln.workers.ops.device import Gpu

log = logging.getLogger(__name__)


def require_tensorrt() -> None:
    """Fail with a sentence where only the type stubs (a namespace without `Builder`) exist."""
    try:
        import tensorrt as trt
    except ImportError:
        raise BackendUnavailableError("The tensorrt package is not installed.") from None
    if not hasattr(trt, "Builder"):
        raise BackendUnavailableError("Only the tensorrt type stubs are installed, not TensorRT.")


@functools.cache
def trt_logger() -> trt.ILogger:
    """TensorRT keeps one logger pointer per process and ignores (with a warning) any other
    passed later, so Kiln creates one on first use and passes that one everywhere. It forwards
    TensorRT's messages to `logging`."""
    import tensorrt as trt

    # `tensorrt` is Any to mypy when the stubs are not visible (they lack py.typed).
    class Forward(trt.ILogger):  # type: ignore[misc, unused-ignore]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: trt.ILogger.Severity, msg: str) -> None:
            log.log(python_level(int(severity)), "TensorRT: %s", msg)

    return Forward()


# --- plans --------------------------------------------------------------------------------


def _plan_spec_here(request: EngineRequest, gpu: Gpu, precision: PrecisionSetting) -> PlanSpec:
    import tensorrt as trt

    return plan_spec(
        request, gpu, precision, tensorrt_version=trt.__version__, fast_fp16=_fast_fp16
    )


def _fast_fp16() -> bool:
    import tensorrt as trt

    return bool(trt.Builder(trt_logger()).platform_has_fast_fp16)


def build_plan(spec: PlanSpec, store: ObjectStore) -> bytes:
    """Parse the ONNX file, configure precision, profile and timing cache, and build."""
    import tensorrt as trt

    builder = trt.Builder(trt_logger())
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, trt_logger())
    if not parser.parse_from_file(str(spec.onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineBuildError(parse_failure(spec.onnx_path, errors))
    config = builder.create_builder_config()
    if spec.precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    _add_profile(builder, network, config, spec.profile)
    timing_key = timing_cache_key(spec.key.tensorrt_version, spec.key.gpu)
    _use_timing_cache(config, read_timing_cache(store, timing_key))
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineBuildError(
            f"TensorRT could not build {spec.model} ({spec.precision}); its log above says why."
        )
    write_timing_cache(store, timing_key, bytes(config.get_timing_cache().serialize()))
    return bytes(plan)


def _add_profile(
    builder: trt.Builder,
    network: trt.INetworkDefinition,
    config: trt.IBuilderConfig,
    profile: tuple[TensorRange, ...],
) -> None:
    """One optimization profile over the batch axis of the dynamic inputs (none if all are
    fixed: TensorRT refuses an empty profile)."""
    import tensorrt as trt

    names = {network.get_input(i).name for i in range(network.num_inputs)}
    if names != {r.name for r in profile}:
        raise EngineBuildError(
            f"TensorRT sees inputs {sorted(names)}, the ONNX file declares "
            f"{sorted(r.name for r in profile)}."
        )
    dynamic = [r for r in profile if r.dynamic]
    if not dynamic:
        return
    shapes = builder.create_optimization_profile()
    for r in dynamic:
        shapes.set_shape(
            r.name, trt.Dims(list(r.min)), trt.Dims(list(r.opt)), trt.Dims(list(r.max))
        )
    if config.add_optimization_profile(shapes) < 0:
        raise EngineBuildError(f"TensorRT refused the optimization profile {dynamic}.")


def _use_timing_cache(config: trt.IBuilderConfig, data: bytes) -> None:
    """Start from the stored timings; a cache TensorRT refuses is replaced by an empty one."""
    try:
        cache = config.create_timing_cache(data)
        if config.set_timing_cache(cache, ignore_mismatch=False):
            return
        log.warning("TensorRT refused the stored timing cache; starting an empty one")
    except Exception as error:  # a corrupt cache only costs build time
        log.warning("TensorRT timing cache unreadable (%s); starting an empty one", error)
    config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatch=False)


def _deserialize(runtime: trt.Runtime, plan: bytes) -> trt.ICudaEngine | None:
    """None (TensorRT logs why) for a plan from another TensorRT, GPU, or corrupt bytes."""
    engine: trt.ICudaEngine | None = runtime.deserialize_cuda_engine(plan)
    return engine


@dataclass(frozen=True)
class LoadedPlan:
    """A deserialized engine, the runtime it must not outlive, and what it was built from."""

    spec: PlanSpec
    runtime: trt.Runtime
    obtained: Obtained[trt.ICudaEngine]


def load_engine(
    request: EngineRequest,
    store: ObjectStore,
    gpu: Gpu,
    precision: PrecisionSetting,
    *,
    force: bool = False,
) -> LoadedPlan:
    """The one road to a plan: the cached one if it is valid and deserializes (unless `force`),
    else a fresh build, stored for the next worker, then deserialized."""
    require_tensorrt()
    import tensorrt as trt

    spec = _plan_spec_here(request, gpu, precision)
    runtime = trt.Runtime(trt_logger())
    obtained = load_or_build(
        store,
        spec.key,
        build=lambda: build_plan(spec, store),
        load=functools.partial(_deserialize, runtime),
        model=spec.model,
        force=force,
    )
    return LoadedPlan(spec, runtime, obtained)


def prebuild(
    request: EngineRequest,
    settings: Settings,
    store: ObjectStore,
    gpu: Gpu,
    precision: PrecisionSetting | None = None,
    *,
    force: bool = False,
) -> str:
    """Build (unless a valid one is cached) and upload the plan for `request`, without creating
    execution contexts; returns its storage key. (`kiln engines build` loads the model's whole
    predictor instead, which stores the same plans.)"""
    loaded = load_engine(request, store, gpu, precision or settings.precision, force=force)
    key = loaded.spec.key.plan_key
    log.info("TensorRT plan for %s (%s): %s", loaded.spec.model, loaded.obtained.source, key)
    return key


def build_tensorrt_engine(
    request: EngineRequest,
    settings: Settings,
    store: ObjectStore,
    gpu: Gpu,
    runners: int,
    choice: Choice,
) -> TensorRTEngine:
    """The engine for `request` on this process's GPU: the cached plan, else a fresh build."""
    started = time.perf_counter()
    loaded = load_engine(request, store, gpu, settings.precision)
    engine = TensorRTEngine(
        loaded.runtime,
        loaded.obtained.value,
        runners=runners,
        precision=loaded.spec.precision,
        reason=choice.reason,
        max_batch=request.max_batch,
        plan_source=loaded.obtained.source,
        weights_bytes=Path(request.onnx_path).stat().st_size,
    )
    log.info("TensorRT engine for %s ready in %.1f s (plan %s, %d context(s))", loaded.spec.model,
             time.perf_counter() - started, loaded.obtained.source, runners)  # fmt: skip
    return engine


# --- running ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IoTensor:
    name: str
    is_input: bool
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]  # as the engine declares it: -1 where the profile decides
    range: TensorRange | None  # inputs only


def _dims(dims: trt.Dims) -> Shape:
    return tuple(int(dims[i]) for i in range(len(dims)))


def read_io(engine: trt.ICudaEngine) -> list[IoTensor]:
    """The engine's I/O tensors through TensorRT 10's name-based API."""
    import tensorrt as trt

    tensors = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        shape = _dims(engine.get_tensor_shape(name))
        bounds = None
        if is_input and -1 in shape:
            low, opt, high = (_dims(d) for d in engine.get_tensor_profile_shape(name, 0))
            bounds = TensorRange(name, low, opt, high)
        elif is_input:
            bounds = TensorRange.fixed(name, shape)
        dtype = numpy_dtype(engine.get_tensor_dtype(name).name)
        tensors.append(IoTensor(name, is_input, dtype, shape, bounds))
    return tensors


class PinnedStage:
    """Page-locked host memory for one feed (async copies need it), grown when a larger feed
    arrives: the predictor's feed dtype (e.g. uint8 pixels) is known only at the first call."""

    def __init__(self, cp: Any, nbytes: int) -> None:
        self._cp = cp
        self._capacity = 0
        self._memory: Any = None
        self._reserve(nbytes)

    def _reserve(self, nbytes: int) -> None:
        capacity = grown(self._capacity, max(1, nbytes))
        if capacity != self._capacity:
            self._memory = self._cp.cuda.alloc_pinned_memory(capacity)
            self._capacity = capacity

    def hold(self, array: np.ndarray) -> np.ndarray:
        """`array` copied into pinned memory (a view valid until the next `hold`)."""
        self._reserve(array.nbytes)
        view = np.frombuffer(self._memory, dtype=array.dtype, count=array.size)
        view = view.reshape(array.shape)
        np.copyto(view, array)
        return view


class DeviceStage:
    """Device memory for a feed before `prepare` turns it into the engine's input."""

    def __init__(self, cp: Any) -> None:
        self._cp = cp
        self._buffer: Any = cp.empty(0, dtype=cp.uint8)

    def view(self, dtype: np.dtype[np.generic], shape: Shape) -> Any:
        nbytes = buffer_bytes(shape, dtype.itemsize)
        capacity = grown(self._buffer.size, max(1, nbytes))
        if capacity != self._buffer.size:
            self._buffer = self._cp.empty(capacity, dtype=self._cp.uint8)
        return self._buffer[:nbytes].view(dtype).reshape(shape)


@dataclass
class BoundContext:
    """One batch in flight: its own execution context, stream and the buffers bound to it
    (contexts are not shareable between threads; separate streams let one context's copies
    overlap another's compute)."""

    context: trt.IExecutionContext
    stream: Any  # cupy.cuda.Stream
    device: dict[str, Any]  # name → 1-D CuPy array sized for max_batch, engine dtype
    host_out: dict[str, np.ndarray]  # name → 1-D pinned array for each output
    host_in: dict[str, PinnedStage]
    raw: dict[str, DeviceStage] = field(default_factory=dict)


def bind_context(cp: Any, engine: trt.ICudaEngine, tensors: list[IoTensor]) -> BoundContext:
    context = engine.create_execution_context()
    if context is None:
        raise EngineBuildError("TensorRT could not create an execution context (GPU memory?).")
    largest = _largest_shapes(context, tensors)
    device = {t.name: cp.empty(volume(largest[t.name]), dtype=t.dtype) for t in tensors}
    for name, array in device.items():
        # The buffers never move, so their addresses are bound once for the context's lifetime.
        if not context.set_tensor_address(name, array.data.ptr):
            raise EngineBuildError(f"TensorRT refused the device buffer for {name!r}.")
    host_out = {
        t.name: _pinned(cp, t.dtype, volume(largest[t.name])) for t in tensors if not t.is_input
    }
    host_in = {
        t.name: PinnedStage(cp, buffer_bytes(largest[t.name], t.dtype.itemsize))
        for t in tensors
        if t.is_input
    }
    return BoundContext(context, cp.cuda.Stream(non_blocking=True), device, host_out, host_in)


def _largest_shapes(context: trt.IExecutionContext, tensors: list[IoTensor]) -> dict[str, Shape]:
    """Every tensor's shape at the profile's max batch: the inputs are set to their largest
    shapes, and TensorRT infers the outputs' from them."""
    inputs = {t.name: t.range for t in tensors if t.range is not None}
    for name, bounds in inputs.items():
        if bounds.dynamic and not context.set_input_shape(name, bounds.max):
            raise EngineBuildError(f"TensorRT refused shape {bounds.max} for {name!r}.")
    return {
        t.name: inputs[t.name].max
        if t.name in inputs
        else concrete_shape(t.name, _dims(context.get_tensor_shape(t.name)))
        for t in tensors
    }


def _pinned(cp: Any, dtype: np.dtype[np.generic], count: int) -> np.ndarray:
    memory = cp.cuda.alloc_pinned_memory(max(1, count * dtype.itemsize))
    return np.frombuffer(memory, dtype=dtype, count=count)  # the array keeps `memory` alive


def _to_device(target: Any, pinned: np.ndarray, stream: Any) -> None:
    target.data.copy_from_host_async(ctypes.c_void_p(pinned.ctypes.data), pinned.nbytes, stream)


def _to_host(source: Any, pinned: np.ndarray, stream: Any) -> None:
    source.data.copy_to_host_async(ctypes.c_void_p(pinned.ctypes.data), pinned.nbytes, stream)


class TensorRTEngine:
    """A deserialized engine with `runners` execution contexts; `infer` is safe from that many
    threads at once (more wait for a free context)."""

    def __init__(
        self,
        runtime: trt.Runtime,
        engine: trt.ICudaEngine,
        *,
        runners: int,
        precision: Precision,
        reason: str,
        max_batch: int,
        plan_source: str,
        weights_bytes: int = 0,
    ) -> None:
        import cupy

        self._cp = cupy
        self._runtime = runtime  # the engine must not outlive its runtime
        self._engine = engine
        tensors = read_io(engine)
        self._inputs = {t.name: t for t in tensors if t.is_input}
        self._outputs = [t.name for t in tensors if not t.is_input]
        self.backend = f"tensorrt:{precision}"
        self.reason = reason
        self.plan_source = plan_source  # "cache" or "built": what a new worker did
        self.inputs = [spec_of(t) for t in tensors if t.is_input]
        self.outputs = [spec_of(t) for t in tensors if not t.is_input]
        ranges = [t.range for t in tensors if t.range is not None]
        self.max_batch = engine_max_batch(ranges, max_batch)
        contexts = [bind_context(cupy, engine, tensors) for _ in range(max(1, runners))]
        self._contexts = ContextPool(contexts)
        # For the memory budget: each context's buffers and scratch, and the weights (the ONNX
        # file's size: FP16 plans hold about half, so this errs high).
        scratch = engine.device_memory_size_v2
        buffers = sum(a.nbytes for bound in contexts for a in bound.device.values())
        self.memory_bytes = int(buffers + len(contexts) * scratch + weights_bytes)

    def infer(
        self, feeds: Mapping[str, np.ndarray], prepare: Mapping[str, Prepare] | None = None
    ) -> dict[str, np.ndarray]:
        check_names(self._inputs, feeds)
        steps = prepare or {}
        with self._contexts.take() as bound, bound.stream:
            try:
                for name, feed in feeds.items():
                    self._stage(bound, name, np.ascontiguousarray(feed), steps.get(name))
                if not bound.context.execute_async_v3(bound.stream.ptr):
                    raise RuntimeError("TensorRT could not enqueue the batch; its log says why.")
                return self._collect(bound)
            finally:
                bound.stream.synchronize()  # nothing in flight when the context is reused

    def _stage(
        self, bound: BoundContext, name: str, feed: np.ndarray, step: Prepare | None
    ) -> None:
        """Host → pinned → device on the context's stream; `step` runs on the device and its
        result is written into the engine's input buffer."""
        tensor = self._inputs[name]
        assert tensor.range is not None
        if step is None:
            check_feed(tensor.range, feed.shape, feed.dtype, tensor.dtype)
            _to_device(
                bound.device[name][: feed.size], bound.host_in[name].hold(feed), bound.stream
            )
            shape = feed.shape
        else:
            raw = bound.raw.setdefault(name, DeviceStage(self._cp)).view(feed.dtype, feed.shape)
            _to_device(raw, bound.host_in[name].hold(feed), bound.stream)
            ready = step(self._cp, raw)  # runs on bound.stream: it is the current stream
            check_feed(tensor.range, ready.shape, ready.dtype, tensor.dtype)
            bound.device[name][: ready.size].reshape(ready.shape)[...] = ready
            shape = ready.shape
        if not bound.context.set_input_shape(name, tuple(shape)):
            raise ValueError(f"TensorRT refused shape {tuple(shape)} for input {name!r}.")

    def _collect(self, bound: BoundContext) -> dict[str, np.ndarray]:
        """Device → pinned for every output, one wait, then NumPy copies (the pinned memory
        belongs to the context and is reused by its next batch)."""
        views = {}
        for name in self._outputs:
            shape = concrete_shape(name, _dims(bound.context.get_tensor_shape(name)))
            pinned = bound.host_out[name][: volume(shape)]
            _to_host(bound.device[name], pinned, bound.stream)
            views[name] = pinned.reshape(shape)
        bound.stream.synchronize()
        return {name: view.copy() for name, view in views.items()}


def spec_of(tensor: IoTensor) -> TensorSpec:
    shape = tuple(d if d >= 0 else None for d in tensor.shape)
    return TensorSpec(tensor.name, shape, str(tensor.dtype))
