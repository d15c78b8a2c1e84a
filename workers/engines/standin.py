"""The device stand-in (`KILN_DEVICE_STANDIN=h200`): benches and tests only. `kiln run` and
`kiln worker` take the very path a GPU host takes for image models — chunks, prep checking
headers, the Batcher, `ImageStages` (decode → fit → forward → outputs), outputs, writes — with
only the device's own work replaced by calibrated waits that release the GIL:

- decode (`StandinJpeg`): torchvision's decoder with its nvJPEG op replaced: ~47 µs an image
  + 0.2 ms a batch behind one process-wide lock (torchvision's own is a mutex per process),
  one precise wait per batch; each image comes back as a CHW uint8 tensor of its JPEG's size;
- forward (`StandinEngine.forward_tensors`): the H200 engine's time for the batch size,
  queued on one serial device clock as a CUDA launch is (the call returns at once; the last
  stage's wait for its event is where the time shows, as on a GPU); outputs are zeros of the
  model's output shapes (read from its ONNX file), copied back at PCIe speed;
- a model's device step after the forward (`image_stages.DevicePost`: the detector's
  candidates), run on the meta outputs, so what is copied back has the shapes it makes: a
  stated `POST_S` a batch on the same clock (a handful of small kernels; not yet measured on
  the H200).

Why torch's "meta" device, not CPU tensors, for what decode and fit make: a meta tensor has
its real shape (so a fit's letterbox scale and crop are right) and every op on it goes
through Python, the dispatcher and the GIL hand-off as on a GPU, where kernels are only
launched; but no pixel arithmetic runs. A GPU host does not resize on its CPU, so CPU tensors
would charge the host for the device's work (fit of 32 images would cost milliseconds here).
Torch's intra-op threads are set to 1 for the same reason: an op on the CPU opening an
OpenMP region costs milliseconds of CPU with two threads.

Nothing here is a result: the engine's backend says `standin:h200`, its reason says
stand-in. What it adds to measure (`Probe`, written to `KILN_DEVICE_STANDIN_REPORT` every
second and at exit): the device's busy seconds; each thread's CPU seconds (by its CPU clock,
read by a sampler thread every 0.1 s, so a thread that ends early loses at most that) and
the prep processes', also at the first and the last tick that saw batches run (a steady
window: start-up and the close outside it); the process's peak thread count; the GIL
release points per batch of each single-threaded stage (torch calls counted with a
TorchFunctionMode on every 4th batch of each stage thread, plus the tensors handed over
between stages: a `record_stream` each on a GPU); and the device stages' verdicts. None
of it exists unless the setting is on.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.workers.device.decoders import Sizes, TorchvisionJpeg
from kiln.workers.device.stages import CudaStreams
from kiln.workers.engines.base import Choice, EngineRequest, TensorSpec
from kiln.workers.ops.device import Gpu

log = logging.getLogger(__name__)

SAMPLE_EVERY = 4  # a stage thread counts its torch calls on one batch in this many
SAMPLER_S = 0.1  # between two reads of every thread's CPU clock
WRITE_S = 1.0  # between two writes of the report
IDLE_S = 1.0  # batches resuming after this long open a new steady window
# A model's device step after the forward (a max over classes, a top-k, a gather on a batch's
# outputs): a few kernel launches on a GPU, ~10 µs each. Stated, not measured on the H200.
POST_S = 50e-6


@dataclass(frozen=True)
class Calibration:
    """A device's costs, measured on it (docs/gpu.md)."""

    name: str
    gpu: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    decode_image_s: float  # torchvision's nvJPEG on one thread, per image…
    decode_batch_s: float  # …and per batch
    forward_ms: tuple[tuple[int, float], ...]  # the engine alone, by batch size
    copy_latency_s: float  # a copy back: its fixed cost…
    copy_bytes_per_s: float  # …and its rate

    def forward_s(self, rows: int) -> float:
        """Linear between the table's batch sizes, proportional to the rows beyond them."""
        table = self.forward_ms
        if rows <= table[0][0]:
            return table[0][1] / 1000 * rows / table[0][0]
        for (low, low_ms), (high, high_ms) in itertools.pairwise(table):
            if rows <= high:
                return (low_ms + (high_ms - low_ms) * (rows - low) / (high - low)) / 1000
        last, last_ms = table[-1]
        return last_ms / 1000 * rows / last

    def decode_s(self, images: int) -> float:
        return self.decode_batch_s + self.decode_image_s * images

    def copy_s(self, nbytes: int) -> float:
        return self.copy_latency_s + nbytes / self.copy_bytes_per_s


# H200, 2026-11-27 (docs/gpu.md): torchvision decodes 21,385 images/s on one thread; the
# ResNet-50 engine alone at b16 1.84 ms, b32 2.81, b64 5.59, b256 21.6.
CALIBRATIONS = {
    "h200": Calibration(
        name="h200", gpu="NVIDIA H200 (stand-in)", memory_bytes=141 * 10**9,
        compute_capability=(9, 0), decode_image_s=47e-6, decode_batch_s=0.2e-3,
        forward_ms=((16, 1.84), (32, 2.81), (64, 5.59), (256, 21.6)),
        copy_latency_s=15e-6, copy_bytes_per_s=20e9,
    ),
}  # fmt: skip


def calibration(name: str) -> Calibration:
    try:
        return CALIBRATIONS[name]
    except KeyError:
        raise ValueError(f"No device stand-in {name!r}; use {', '.join(CALIBRATIONS)}.") from None


# --- waiting --------------------------------------------------------------------------------


class Waiter:
    """Sleeps to a deadline in one `time.sleep` (which releases the GIL), less what sleeps
    have overshot lately (the kernel's timer slack is ~50 µs: as much as an image's decode)."""

    def __init__(self) -> None:
        self._slack = 0.0

    def until(self, deadline: float) -> None:
        left = deadline - time.perf_counter() - self._slack
        if left > 0:
            time.sleep(left)
            over = time.perf_counter() - deadline
            self._slack = max(0.0, min(0.5e-3, 0.9 * self._slack + 0.1 * (self._slack + over)))


@dataclass
class Busy:
    """Seconds the stand-in device spent, by kind, and the batches and rows behind them."""

    seconds: dict[str, float] = field(default_factory=dict)
    batches: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # the forwards' batch sizes
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, seconds: float, rows: int) -> None:
        with self.lock:  # decode, forward and the copies back add from their own threads
            self._add(kind, seconds, rows)

    def _add(self, kind: str, seconds: float, rows: int) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
        self.batches[kind] = self.batches.get(kind, 0) + 1
        self.rows[kind] = self.rows.get(kind, 0) + rows
        if kind == "forward":
            self.sizes[rows] = self.sizes.get(rows, 0) + 1


class DeviceClock:
    """One device's work in order: each piece starts when the device is free (a CUDA stream
    runs its kernels one after another), and the caller waits only when it asks (`until`)."""

    def __init__(self, busy: Busy) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._busy = busy
        self._waiter = Waiter()

    def queue(self, kind: str, seconds: float, rows: int) -> float:
        """Queue `seconds` of work; when it will be done."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + seconds
            self._busy.add(kind, seconds, rows)
            return self._free_at

    @property
    def free_at(self) -> float:
        with self._lock:
            return self._free_at

    def until(self, deadline: float) -> None:
        self._waiter.until(deadline)


# --- decode ---------------------------------------------------------------------------------

_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_ALONE = {0x01, 0xD8, *range(0xD0, 0xD8)}  # markers without a length


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) as stored, from the JPEG's frame header; None if there is none."""
    i, end = 2, len(data) - 9
    while i < end:
        if data[i] != 0xFF:
            i += 1
            continue
        marker = data[i + 1]
        if marker == 0xFF or marker in _ALONE:
            i += 1 if marker == 0xFF else 2
            continue
        if marker in _SOF:
            return int.from_bytes(data[i + 5 : i + 7]), int.from_bytes(data[i + 7 : i + 9])
        i += 2 + int.from_bytes(data[i + 2 : i + 4])
    return None


class StandinJpeg(TorchvisionJpeg):
    """torchvision's decoder (its host work per image included) with the nvJPEG op replaced:
    one wait per batch behind a process-wide lock, then per image an empty CHW uint8 tensor
    of its size on the stand-in's device (None where no size was found: Pillow decodes it)."""

    name = "standin"
    concurrent = False
    # the sizes prep read from the headers: a GPU host does not read them again to decode
    wants_sizes = True

    def __init__(self, calibration: Calibration, busy: Busy, lock: threading.Lock) -> None:
        super().__init__(self._op)
        self._calibration = calibration
        self._busy = busy
        self._lock = lock  # the process's (`Probe.decode_lock`): every model's decoder shares it
        self._waiter = Waiter()
        self._sizes = threading.local()

    def decode(
        self, datas: Sequence[bytes | memoryview], device: Any, sizes: Sizes | None = None
    ) -> list[Any | None]:
        """Without `sizes` (a caller with no headers), read from each JPEG's frame header."""
        found = list(sizes) if sizes is not None else [jpeg_size(d) for d in datas]
        self._sizes.found = found
        return super().decode(datas, device)

    def _op(self, encoded: list[Any], device: Any) -> list[Any]:
        import torch

        found: list[tuple[int, int] | None] = self._sizes.found
        # a batch the op refused is tried image by image (`batch_or_alone`): no sizes then
        sizes = found if len(encoded) == len(found) else [None] * len(encoded)
        with self._lock:
            started = time.perf_counter()
            self._waiter.until(started + self._calibration.decode_s(len(encoded)))
            self._busy.add("decode", time.perf_counter() - started, len(encoded))
        images: list[Any] = [None] * len(encoded)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, size in enumerate(sizes):
            if size is not None:
                groups.setdefault(size, []).append(i)
        for (height, width), members in groups.items():  # one tensor a size, as a batch is
            block = torch.empty((len(members), 3, height, width), dtype=torch.uint8, device=device)
            for i, image in zip(members, block.unbind(0), strict=True):
                images[i] = image
        return images


# --- streams: CudaStreams' own code, on a clock instead of CUDA ---------------------------


@dataclass
class _Counted:
    """What one stage thread counted on its sampled batches."""

    thread: str
    batches: int = 0
    sampled: int = 0
    calls: int = 0  # torch calls but attribute reads (`.shape`: no GIL release)
    reads: int = 0
    handed: int = 0
    names: dict[str, int] = field(default_factory=dict)  # of the first sampled batch
    quiet: bool = False  # a hand-over's own call: counted as one, apart


class _Stream:
    """A stage thread's stand-in stream: its counts, and whether this batch is sampled."""

    def __init__(self, clock: DeviceClock, counted: _Counted) -> None:
        self.clock = clock
        self.counted = counted
        self.sampling = False

    def record_event(self) -> float:
        return self.clock.free_at  # done when all the device work queued so far is

    def wait_event(self, event: Any) -> None:
        return None  # the device orders its own work


class _Cuda:
    """The `torch.cuda` that `CudaStreams` uses: streams, and `stream(s)` entering it."""

    def __init__(self, probe: Probe, clock: DeviceClock) -> None:
        self._probe = probe
        self._clock = clock

    def Stream(self, device: Any = None) -> _Stream:  # torch.cuda's name
        return _Stream(self._clock, self._probe.counted(threading.current_thread().name))

    @contextlib.contextmanager
    def stream(self, stream: _Stream) -> Iterator[None]:
        counted = stream.counted
        counted.batches += 1
        stream.sampling = counted.batches % SAMPLE_EVERY == 1
        if not stream.sampling:
            yield
            return
        counted.sampled += 1
        with _counting(counted):
            yield
        stream.sampling = False


class _Torch:
    """torch, but for its `cuda`: what `CudaStreams` is built with here."""

    def __init__(self, torch: Any, cuda: _Cuda) -> None:
        self._torch = torch
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


class StandinStreams(CudaStreams):
    """`CudaStreams` as it is, over a stand-in `torch.cuda`: a stage's `using` enters the
    device (meta) and its stream (which counts torch calls on sampled batches); an event is
    the device clock's time, so the last stage's `settle` waits for the forward queued before
    it, as on a GPU. A meta tensor is not `is_cuda`: each one `hand_over` reaches is counted
    as the `record_stream` it would be on a GPU, and pays a binding that releases the GIL as
    `record_stream` does (`detach`: a µs or two, as `record_stream`'s allocator entry)."""

    def __init__(self, torch: Any, probe: Probe, clock: DeviceClock) -> None:
        super().__init__(_Torch(torch, _Cuda(probe, clock)), "meta")
        self._clock = clock
        self._tensor = torch.Tensor

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def hand_over(self, value: Any, stream: Any) -> None:
        if isinstance(value, self._tensor):
            counted = stream.counted
            counted.quiet = True
            value.detach()
            counted.quiet = False
            if stream.sampling:
                counted.handed += 1
            return
        super().hand_over(value, stream)

    def settle(self, event: Any) -> None:
        if event is not None:
            self._clock.until(float(event))


def _counting(counted: _Counted) -> contextlib.AbstractContextManager[None]:
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            name = getattr(func, "__name__", "?")
            if counted.quiet:
                pass
            elif name == "__get__":
                counted.reads += 1
            else:
                counted.calls += 1
                if counted.sampled == 1:
                    counted.names[name] = counted.names.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    return Count()


# --- meta kernels as cheap as a launch ---------------------------------------------------


@functools.cache
def fast_meta_kernels() -> Any:
    """Meta kernels for the ops the fit uses whose own are Python decompositions (measured on
    torch 2.13's CPU build, 32 images of 640×480: `stack` 380 µs, `clamp_` 1,150 µs, `round_`
    73 µs, `cat` 380 µs, each holding the GIL): the shape alone, in a few µs, about what an op
    costs the host on a GPU, where its kernel is only launched. The rest of the fit's ops
    (`to`, `interpolate`, `permute`, `contiguous`, slicing, index assignment) have C++ meta
    kernels of 1–20 µs and stay. Process-wide, and made only where the stand-in runs: the
    library object is kept (its kernels go with it)."""
    import torch

    library: Any = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
    library.impl("stack", _stacked, "Meta")
    library.impl("cat", _joined, "Meta")
    library.impl("clamp_", lambda self, min=None, max=None: self, "Meta")
    library.impl("round_", lambda self: self, "Meta")
    return library


def _stacked(tensors: Sequence[Any], dim: int = 0) -> Any:
    shape = list(tensors[0].shape)
    shape.insert(dim if dim >= 0 else len(shape) + dim + 1, len(tensors))
    return tensors[0].new_empty(shape)


def _joined(tensors: Sequence[Any], dim: int = 0) -> Any:
    shapes = [t.shape for t in tensors if t.dim() > 1 or t.numel() > 0]  # cat skips empty 1-d
    shape = list(shapes[0])
    shape[dim] = sum(s[dim] for s in shapes)
    return tensors[0].new_empty(shape)


# --- the engine -----------------------------------------------------------------------------


class _Pending(list[Any]):
    """A forward's device outputs, and when the device will have made them."""

    ready_at: float = 0.0


class StandinEngine:
    """An engine for `DeviceFeeds` predictors with the device's work replaced (module doc)."""

    def __init__(self, request: EngineRequest, calibration: Calibration, probe: Probe) -> None:
        import torch

        torch.set_num_threads(1)  # no OpenMP region for an op on the host (module doc)
        fast_meta_kernels()
        self._torch = torch
        self.calibration = calibration
        self.device = torch.device("meta")
        self.backend = f"standin:{calibration.name}"
        self.reason = (
            f"KILN_DEVICE_STANDIN={calibration.name}: a calibrated stand-in for the "
            f"{calibration.gpu}; the device's work is waited, not done (benches and tests only)"
        )
        self.onnx_path = Path(request.onnx_path)
        self.inputs, self.outputs = model_specs(self.onnx_path)
        self._shapes: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        self.max_batch = request.max_batch
        self.probe = probe
        self.clock = probe.clock
        self.jpeg_decoder = StandinJpeg(calibration, probe.busy, probe.decode_lock)
        self._copies = Waiter()
        self._buffers = threading.local()

    def streams(self) -> StandinStreams:
        return StandinStreams(self._torch, self.probe, self.clock)

    def watch(self, device_stages: Any) -> None:
        """The device stages feeding this engine: their verdict goes in the report."""
        self.probe.device_stages.append(device_stages)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The device as the default for new tensors, as the torch engine's (no stream)."""
        with self.device:
            yield

    def infer(self, feeds: Mapping[str, np.ndarray], prepare: Any = None) -> dict[str, Any]:
        """A host batch (`batch_size.choose_batch`'s sweep): forward, copy back."""
        pixels = feeds[self.inputs[0].name]
        return self.outputs_to_host(self._queue(pixels.shape, "sweep"), len(pixels))

    def infer_tensors(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        rows = int(next(iter(tensors.values())).shape[0])
        return self.outputs_to_host(self.forward_tensors(tensors), rows)

    def forward_tensors(self, tensors: Mapping[str, Any]) -> list[Any]:
        return self._queue(tuple(tensors[self.inputs[0].name].shape))

    def post_processed(self, outputs: list[Any], reduced: list[Any]) -> _Pending:
        """A model's device step on a forward's `outputs` (`image_stages.posted`): queued
        after them on the device clock; `reduced` (meta tensors of the shapes it makes) is
        what the copy back then reads."""
        rows = int(reduced[0].shape[0]) if reduced else 0
        pending = _Pending(reduced)
        pending.ready_at = max(getattr(outputs, "ready_at", 0.0),
                               self.clock.queue("post", POST_S, rows))  # fmt: skip
        return pending

    def _queue(self, shape: tuple[int, ...], kind: str = "forward") -> _Pending:
        """The forward of a batch of `shape` (NHWC) queued on the device: its outputs."""
        rows, height, width = int(shape[0]), int(shape[1]), int(shape[2])
        sides = self._output_sides(height, width)
        torch = self._torch
        pending = _Pending(
            torch.empty((rows, *dims), dtype=getattr(torch, spec.dtype), device=self.device)
            for spec, dims in zip(self.outputs, sides, strict=True)
        )
        pending.ready_at = self.clock.queue(kind, self.calibration.forward_s(rows), rows)
        return pending

    def _output_sides(self, height: int, width: int) -> list[tuple[int, ...]]:
        """Each output's sides but the batch for inputs of this size: the ONNX file's, or
        where they follow the input's size, what ONNX Runtime makes of one image (once)."""
        sides = self._shapes.get((height, width))
        if sides is None:
            fixed = [s.shape[1:] for s in self.outputs]
            if all(isinstance(d, int) for dims in fixed for d in dims):
                sides = [tuple(int(d) for d in dims) for dims in fixed]  # type: ignore[arg-type]
            else:
                sides = _run_once(self.onnx_path, height, width)
            self._shapes[(height, width)] = sides
        return sides

    def outputs_to_host(self, values: list[Any], rows: int) -> dict[str, np.ndarray]:
        """Once the forward is done: the copy back's wait, then, as the torch engine hands
        them over, copies of this thread's staging buffers (zeros here)."""
        self.clock.until(getattr(values, "ready_at", 0.0))
        staged = {spec.name: self._staging(spec, (rows, *value.shape[1:]))
                  for spec, value in zip(self.outputs, values, strict=True)}  # fmt: skip
        nbytes = sum(a.nbytes for a in staged.values())
        started = time.perf_counter()
        self._copies.until(started + self.calibration.copy_s(nbytes))
        self.probe.busy.add("copy", time.perf_counter() - started, rows)
        return {name: array.copy() for name, array in staged.items()}

    def _staging(self, spec: TensorSpec, shape: tuple[int, ...]) -> np.ndarray:
        """This thread's buffer for an output, grown to `shape` (the pinned one on a GPU)."""
        buffers: dict[str, np.ndarray] = self._buffers.__dict__.setdefault("by_name", {})
        buffer = buffers.get(spec.name)
        if buffer is None or buffer.shape[1:] != shape[1:] or len(buffer) < shape[0]:
            buffer = buffers[spec.name] = np.zeros(shape, dtype=spec.dtype)
        return buffer[: shape[0]]


def model_specs(onnx_path: Path) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The engine's input (uint8 NHWC, as GPU engines take an image model's pixels: a side
    the ONNX file leaves open stays open) and its outputs (None: a side not fixed)."""
    import onnx
    from onnx import helper

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    feed = next(i for i in graph.input if i.name not in initializers)
    dims = [d.dim_value or None for d in feed.type.tensor_type.shape.dim]
    if len(dims) != 4 or dims[1] != 3:
        raise ValueError(f"The stand-in takes NCHW RGB images, not {dims}.")
    inputs = [TensorSpec(feed.name, (None, dims[2], dims[3], 3), "uint8")]
    outputs = []
    for out in graph.output:
        shape = [d.dim_value or None for d in out.type.tensor_type.shape.dim][1:]
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(out.type.tensor_type.elem_type))
        outputs.append(TensorSpec(out.name, (None, *shape), dtype.name))
    return inputs, outputs


def _run_once(onnx_path: Path, height: int, width: int) -> list[tuple[int, ...]]:
    """The outputs' sides (but the batch) for one image of this size, by ONNX Runtime."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feed = session.get_inputs()[0]
    outputs = session.run(None, {feed.name: np.zeros((1, 3, height, width), np.float32)})
    return [tuple(int(d) for d in out.shape[1:]) for out in outputs]


# --- choosing it ----------------------------------------------------------------------------

BACKEND = "standin"  # EngineFactory's name for it (a `Choice`)


def choice(name: str) -> Choice:
    return Choice(BACKEND, f"KILN_DEVICE_STANDIN={name} (benches and tests only)")


def gpu(name: str) -> Gpu:
    """The device the stand-in stands in for, as NVML would list it (the memory budget)."""
    c = calibration(name)
    return Gpu(0, c.gpu, f"standin-{c.name}", c.compute_capability, c.memory_bytes)


_probes: dict[str, Probe] = {}
_probes_lock = threading.Lock()


def probe(name: str, report: Path | None) -> Probe:
    """The process's one probe for this stand-in (its device clock is the device's)."""
    with _probes_lock:
        found = _probes.get(name)
        if found is None:
            found = _probes[name] = Probe(calibration(name), report)
        return found


def build(request: EngineRequest, name: str, report: Path | None) -> StandinEngine:
    return StandinEngine(request, calibration(name), probe(name, report))


# --- the report -----------------------------------------------------------------------------


class Probe:
    """The stand-in's measurements in this process (module doc), written to `report`."""

    def __init__(self, calibration: Calibration, report: Path | None) -> None:
        self.calibration = calibration
        self.busy = Busy()
        self.clock = DeviceClock(self.busy)
        self.decode_lock = threading.Lock()  # torchvision's decoder: one per process
        self.device_stages: list[Any] = []
        self.started = time.perf_counter()
        self._counted: dict[str, _Counted] = {}
        self._lock = threading.Lock()
        self._cpu: dict[int, tuple[str, float]] = {}  # by native thread id: name, CPU seconds
        self._peak_threads = 0
        self._rows_seen = 0  # the forwards' rows at the last tick
        # the CPU at the first and the last tick that saw batches run (`_edge`)
        self._edges: dict[str, dict[str, Any]] = {}
        self._report = report
        if report is not None:
            threading.Thread(target=self._sample, name="kiln-standin-probe", daemon=True).start()
            atexit.register(self.write)

    def counted(self, thread: str) -> _Counted:
        with self._lock:
            return self._counted.setdefault(thread, _Counted(thread))

    def _sample(self) -> None:
        written = time.monotonic()
        while True:
            self.read_threads()
            if time.monotonic() - written >= WRITE_S:
                self.write()
                written = time.monotonic()
            time.sleep(SAMPLER_S)

    def read_threads(self) -> None:
        """Every thread's CPU clock (Linux: a thread's clock id from its id), by name; and a
        tick of the timeline."""
        names = {t.native_id: t.name for t in threading.enumerate()}
        try:
            tids = [int(t.name) for t in Path("/proc/self/task").iterdir()]
        except OSError:
            tids = [t for t in names if t is not None]
        read = {}
        with self._lock:  # a thread ending has left Python's list but not yet /proc: the
            known = {tid: cpu[0] for tid, cpu in self._cpu.items()}  # name it had stays
        for tid in tids:
            try:
                seconds = time.clock_gettime(((~tid) << 3) | 6)  # CPUCLOCK_SCHED, per thread
            except OSError:  # it ended
                continue
            read[tid] = (names.get(tid) or known.get(tid) or _native_name(tid), seconds)
        busy = self.busy
        # a tick: monotonic seconds, the forwards' rows and seconds, the process's CPU seconds
        forward_s = round(busy.seconds.get("forward", 0.0), 6)
        tick = (round(time.monotonic(), 4), busy.rows.get("forward", 0), forward_s,
                round(time.process_time(), 4))  # fmt: skip
        with self._lock:
            self._cpu.update(read)
            self._peak_threads = max(self._peak_threads, len(tids))
            ran, self._rows_seen = tick[1] > self._rows_seen, tick[1]
        if ran:  # batches ran since the last tick: a window's edge
            self._edge(tick)

    def _edge(self, tick: tuple[float, int, float, float]) -> None:
        """The threads' and prep processes' CPU at this tick: the window's first edge (the
        first tick after a batch, or after IDLE_S without one: a worker's next job) or its
        last so far."""
        edge = {"tick": tick, "prep_cpu_s": children_cpu(), "threads": self._threads()}
        with self._lock:
            last = self._edges.get("last")
            if last is None or tick[0] - last["tick"][0] > IDLE_S:
                self._edges["first"] = edge
            self._edges["last"] = edge

    def _threads(self) -> list[dict[str, Any]]:
        with self._lock:
            return [{"tid": tid, "name": n, "cpu_s": round(s, 6)}
                    for tid, (n, s) in self._cpu.items()]  # fmt: skip

    def snapshot(self) -> dict[str, Any]:
        threads = self._threads()
        with self._lock:
            edges = dict(self._edges)
            counted = [{**vars(c), "names": dict(c.names)} for c in self._counted.values()]
            peak = self._peak_threads
        busy = self.busy
        with busy.lock:
            seconds, batches, rows = dict(busy.seconds), dict(busy.batches), dict(busy.rows)
            sizes = {str(k): v for k, v in sorted(busy.sizes.items())}
        return {
            "standin": self.calibration.name,
            "wall_s": round(time.perf_counter() - self.started, 3),
            "busy_s": {k: round(v, 6) for k, v in seconds.items()},
            "batches": batches,
            "rows": rows,
            "batch_sizes": sizes,
            "window": edges,
            "process_cpu_s": round(time.process_time(), 6),
            "peak_threads": peak,
            "threads": threads,
            "stages": counted,
            "pipelines": [
                {"name": p.name, "verdict": p.verdict(), "stats": p.stats()}
                for p in self.device_stages
            ],
        }

    def write(self) -> None:
        if self._report is None:
            return
        try:
            self.read_threads()
            path = self._report
            temporary = path.with_name(f".{path.name}.{os.getpid()}")
            temporary.write_text(json.dumps(self.snapshot()))
            temporary.replace(path)
        except Exception:  # a report is for the bench; never fail the run for it
            log.exception("could not write the device stand-in's report")


def children_cpu(pid: int | str = "self") -> float:
    """CPU seconds of a process's descendants alive now (the prep processes), from /proc:
    each thread's `children`, then each child's `stat` (clock ticks)."""
    total = 0.0
    for child in _children(pid):
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS + children_cpu(child)
    return total


_TICKS = os.sysconf("SC_CLK_TCK")


def _children(pid: int | str) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:  # it ended, or no /proc
        pass
    return found


def _native_name(tid: int) -> str:
    try:
        return "native:" + Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return "native"
