"""The torch engine's way between the host and its device, one per runner thread: host staging
buffers reused batch after batch (pinned on CUDA), a CUDA stream of its own, and that stream as
CuPy sees it, each made on the thread's first use.

What crosses: NumPy feeds → host tensors in the thread's buffers (or device tensors, after a
family's `prepare`); device outputs → NumPy copies, one wait per batch. On the CPU the same
calls run over plain buffers, with no streams. `torch` comes from the engine and `cupy` is
imported here only on CUDA, so this module imports without either.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kiln.workers.engines.base import Prepare, prepared

log = logging.getLogger(__name__)


class Staging:
    """One runner thread's host buffers, reused batch after batch: pinned on CUDA (a pinned
    copy runs without blocking and at the bus's speed), plain on the CPU."""

    def __init__(self, torch: Any, pinned: bool) -> None:
        self._torch = torch
        self._pinned = pinned
        self._buffers: dict[str, Any] = {}  # name → flat uint8 tensor, grown as needed

    def take(self, name: str, shape: Sequence[int], dtype: Any) -> Any:
        """A tensor of `shape` and `dtype` over this thread's buffer `name`."""
        torch = self._torch
        count = int(np.prod(shape)) if len(shape) else 1
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            # device="cpu" said: inside `on_stream` the CUDA device is the default one
            buffer = torch.empty(
                max(nbytes, 1), dtype=torch.uint8, device="cpu", pin_memory=self._pinned
            )
            self._buffers[name] = buffer
        return buffer[:nbytes].view(dtype).view(tuple(shape))


class Transfers:
    """One engine's staging and streams, each runner thread seeing its own (thread-local)."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = device
        self._cuda = device.type == "cuda"
        self._cupy = _cupy() if self._cuda else None
        self._local = threading.local()

    def staging(self) -> Staging:
        """This thread's host buffers."""
        staging = getattr(self._local, "staging", None)
        if staging is None:
            staging = self._local.staging = Staging(self._torch, pinned=self._cuda)
        return staging

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """This thread's CUDA stream, and the device as the default (`TorchEngine.on_stream`)."""
        if not self._cuda:
            yield  # on the CPU everything is already where it must be
            return
        with self._device, self._torch.cuda.stream(self._stream()):
            yield

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The device as the default for new tensors, on whatever stream is current."""
        if not self._cuda:
            yield
            return
        with self._device:
            yield

    def held(self, name: str, feed: np.ndarray) -> Any:
        """The feed as a host tensor in this thread's staging buffer `name` (copied there
        unless it was gathered there already)."""
        torch = self._torch
        dtype = getattr(torch, str(feed.dtype))
        target = self.staging().take(name, feed.shape, dtype)
        if target.data_ptr() != feed.ctypes.data:
            target.copy_(torch.from_numpy(_writable(feed)))
        return target

    def to_host(self, names: Sequence[str], values: list[Any], rows: int) -> dict[str, np.ndarray]:
        """The first `rows` rows of each device output, by name, as host arrays: copied into
        this thread's staging buffers without blocking, then one wait for the whole batch."""
        staging = self.staging()
        held = []
        for name, value in zip(names, values, strict=True):
            part = value[:rows]
            target = staging.take(f"out:{name}", tuple(part.shape), part.dtype)
            target.copy_(part, non_blocking=self._cuda)
            held.append(target)
        if self._cuda:
            self._torch.cuda.current_stream(self._device).synchronize()
        # copies: the staging buffers are this thread's next batch
        return {name: t.numpy().copy() for name, t in zip(names, held, strict=True)}

    def uploaded(
        self, names: Sequence[str], feeds: Mapping[str, np.ndarray], steps: Mapping[str, Prepare]
    ) -> list[Any]:
        """Feeds in `names`' order, on the device, each after its `prepare`: on the GPU with
        CuPy when it imports, else on the host with NumPy (then the prepared array is what
        crosses the bus, e.g. float32 instead of uint8 pixels)."""
        if self._cupy is None:
            ready = prepared(feeds, steps)
            return [self._upload(ready[name]) for name in names]
        tensors = []
        for name in names:
            raw = self._upload(np.ascontiguousarray(feeds[name]))
            step = steps.get(name)
            tensors.append(raw if step is None else self._prepare_on_gpu(raw, step))
        return tensors

    def _stream(self) -> Any:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self._torch.cuda.Stream(device=self._device)
        return stream

    def _upload(self, array: np.ndarray) -> Any:
        return self._torch.from_numpy(_writable(array)).to(self._device)

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


def _writable(array: np.ndarray) -> np.ndarray:
    """torch shares NumPy memory and warns on read-only arrays."""
    return array if array.flags.writeable else array.copy()


def _cupy() -> ModuleType | None:
    try:
        import cupy
    except ImportError:
        log.info("cupy is not installed: the torch engine applies `prepare` on the host")
        return None
    module: ModuleType = cupy
    return module
