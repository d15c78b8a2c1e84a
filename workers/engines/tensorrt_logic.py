"""The TensorRT engine's pure parts: profile shapes, buffer sizes, dtypes, precision, contexts.

Nothing here touches CUDA or imports `tensorrt`, so all of it is tested on a CPU; the engine in
`tensorrt.py` only glues these to the TensorRT and CuPy calls.
"""

from __future__ import annotations

import logging
import math
import queue
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Literal, TypeVar

import numpy as np

from kiln.app.core.errors import KilnError

PrecisionSetting = Literal["auto", "fp16", "fp32"]
Precision = Literal["fp16", "fp32"]
Shape = tuple[int, ...]

T = TypeVar("T")


class EngineBuildError(KilnError):
    """A TensorRT engine cannot be built from this model; the message says why."""


# --- precision and types ------------------------------------------------------------------


def decide_precision(setting: PrecisionSetting, fast_fp16: bool) -> Precision:
    """`auto` takes FP16 only where the GPU runs it fast (`builder.platform_has_fast_fp16`)."""
    if setting == "auto":
        return "fp16" if fast_fp16 else "fp32"
    return setting


# TensorRT `DataType.name` → NumPy. BF16, FP8, INT4, FP4 and E8M0 have no NumPy type.
_NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "FLOAT": np.dtype(np.float32),
    "HALF": np.dtype(np.float16),
    "INT8": np.dtype(np.int8),
    "UINT8": np.dtype(np.uint8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}


def numpy_dtype(trt_name: str) -> np.dtype[np.generic]:
    try:
        return _NUMPY_DTYPES[trt_name]
    except KeyError:
        raise EngineBuildError(
            f"A TensorRT I/O tensor of type {trt_name} has no NumPy equivalent; "
            "export the model with float32, float16 or integer inputs and outputs."
        ) from None


def python_level(severity: int) -> int:
    """TensorRT `ILogger.Severity` (0 internal error … 4 verbose) → a `logging` level."""
    levels = (logging.CRITICAL, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG)
    return levels[severity] if 0 <= severity < len(levels) else logging.DEBUG


def parse_failure(path: Path, messages: Sequence[str]) -> str:
    """One sentence for an ONNX file TensorRT's parser refused, with every parser message."""
    details = "; ".join(m.strip() for m in messages if m.strip()) or "no message from the parser"
    return f"TensorRT could not parse {path.name}: {details}."


# --- optimization profile -----------------------------------------------------------------


@dataclass(frozen=True)
class InputShape:
    """A graph input as the ONNX file declares it: None where a dimension is not fixed."""

    name: str
    dims: tuple[int | None, ...]


@dataclass(frozen=True)
class TensorRange:
    """The shapes an input may take: TensorRT's optimization profile for it (min, opt, max)."""

    name: str
    min: Shape
    opt: Shape
    max: Shape

    @property
    def dynamic(self) -> bool:
        return self.min != self.max

    @classmethod
    def fixed(cls, name: str, shape: Shape) -> TensorRange:
        return cls(name, shape, shape, shape)


def onnx_input_shapes(path: Path) -> list[InputShape]:
    """The graph inputs of an ONNX file (initializers excluded), without loading weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    weights = {i.name for i in model.graph.initializer}
    shapes = []
    for value in model.graph.input:
        if value.name in weights:  # IR < 4 lists initializers as inputs too
            continue
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            raise EngineBuildError(f"Input {value.name!r} of {path.name} has no declared rank.")
        dims = tuple(d.dim_value if d.dim_value > 0 else None for d in tensor.shape.dim)
        shapes.append(InputShape(value.name, dims))
    return shapes


def opt_batch(max_batch: int) -> int:
    """The batch TensorRT tunes its kernels for: `max_batch`.

    Under load the Batcher releases full batches (it fills to `max_batch` before `max_delay`),
    and that is where throughput is made; small interactive batches are latency-bound by the
    copies and launch overhead, where a kernel tuned for a larger batch costs little.
    """
    return max_batch


Axes = tuple[tuple[int, int, int, int], ...]  # (axis, min, opt, max) beyond the batch


def input_range(shape: InputShape, max_batch: int, axes: Axes = ()) -> TensorRange:
    """A dynamic first dimension spans 1…max_batch; any other dynamic dimension spans the range
    `axes` gives for it (a sequence length), or is refused."""
    ranges = {axis: (low, opt, high) for axis, low, opt, high in axes}
    unknown = [i for i, d in enumerate(shape.dims) if d is None and i > 0 and i not in ranges]
    if unknown:
        raise EngineBuildError(
            f"Input {shape.name!r} has dynamic dimension(s) {unknown} besides the batch and no "
            "range for them; export the model with those fixed, or declare their range."
        )
    if not shape.dims or all(d is not None for d in shape.dims):
        return TensorRange.fixed(shape.name, tuple(d for d in shape.dims if d is not None))
    batch = (1, opt_batch(max_batch), max_batch) if shape.dims[0] is None else (shape.dims[0],) * 3
    low, opt, high = [batch[0]], [batch[1]], [batch[2]]
    for axis, dim in enumerate(shape.dims[1:], start=1):
        span = ranges.get(axis, (dim, dim, dim)) if dim is None else (dim, dim, dim)
        low.append(int(span[0] or 0))
        opt.append(int(span[1] or 0))
        high.append(int(span[2] or 0))
    return TensorRange(shape.name, tuple(low), tuple(opt), tuple(high))


def batch_profile(
    shapes: Sequence[InputShape], max_batch: int, axes: Axes = ()
) -> tuple[TensorRange, ...]:
    """One optimization profile over the batch axis (and any declared axis), for every input
    (sorted by name, so the engine cache key does not depend on the graph's input order)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, not {max_batch}.")
    if not shapes:
        raise EngineBuildError("The model declares no inputs.")
    return tuple(sorted((input_range(s, max_batch, axes) for s in shapes), key=lambda r: r.name))


def engine_max_batch(ranges: Sequence[TensorRange], requested: int) -> int:
    """The largest batch the engine accepts: the profile's max batch if any input is dynamic,
    else the fixed batch the model was exported with (one row when it has no batch axis)."""
    dynamic = [r.max[0] for r in ranges if r.dynamic]
    if dynamic:
        return min(requested, *dynamic)
    first = [r.max[0] for r in ranges if r.max]
    return min(requested, *first) if first else 1


def check_feed(
    spec: TensorRange, shape: Shape, dtype: np.dtype[np.generic], want: np.dtype[np.generic]
) -> None:
    """Raise with a sentence unless `shape`/`dtype` fit the engine's input `spec`."""
    if dtype != want:
        raise ValueError(f"Input {spec.name!r} is {dtype}, but the engine takes {want}.")
    low, high = spec.min, spec.max
    fits = len(shape) == len(high) and all(
        lo <= d <= hi for d, lo, hi in zip(shape, low, high, strict=True)
    )
    if not fits:
        raise ValueError(
            f"Input {spec.name!r} has shape {tuple(shape)}; the engine takes {low} to {high}."
        )


def check_names(expected: Iterable[str], feeds: Iterable[str]) -> None:
    want, got = set(expected), set(feeds)
    if want != got:
        raise ValueError(f"The engine takes inputs {sorted(want)}, but was given {sorted(got)}.")


# --- buffers ------------------------------------------------------------------------------


def volume(shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"Shape {tuple(shape)} is not concrete (a -1 remains).")
    return math.prod(shape)


def buffer_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of a dense buffer for `shape` (e.g. an input's max-batch shape)."""
    return volume(shape) * itemsize


def grown(capacity: int, needed: int) -> int:
    """Capacity for a staging buffer that must hold `needed` bytes: unchanged when it fits,
    else at least doubled, so a growing feed reallocates a few times, not on every call."""
    if needed <= capacity:
        return capacity
    return max(needed, 2 * capacity)


def concrete_shape(name: str, shape: Sequence[int]) -> Shape:
    """An output shape once the inputs are known; -1 left means a data-dependent shape."""
    if any(d < 0 for d in shape):
        raise EngineBuildError(
            f"Output {name!r} has a data-dependent shape {tuple(shape)}; Kiln's TensorRT engine "
            "needs outputs whose shape follows from the inputs' shapes."
        )
    return tuple(shape)


# --- execution contexts -------------------------------------------------------------------


class ContextPool(Generic[T]):
    """A fixed set of execution contexts (each with its stream and buffers) shared by runner
    threads: `take()` blocks until one is free and always gives it back, even when the work
    inside raises."""

    def __init__(self, contexts: Iterable[T]) -> None:
        self._free: queue.Queue[T] = queue.Queue()
        for context in contexts:
            self._free.put(context)
        self.size = self._free.qsize()
        if self.size == 0:
            raise ValueError("A context pool needs at least one context.")

    @contextmanager
    def take(self) -> Iterator[T]:
        context = self._free.get()
        try:
            yield context
        finally:
            self._free.put(context)

    def free(self) -> int:
        return self._free.qsize()
