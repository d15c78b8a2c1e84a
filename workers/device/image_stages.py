"""An image model's batches on the GPU as overlapped stages (`device/stages.py`). Where the GPU
decodes (`ImageStages`):

    decode   the JPEGs with the GPU's decoder (`device/decoders.py`), the rest with Pillow;
             one thread per decoder state (nvImageCodec: `KILN_DECODE_THREADS`); hands fit
             one stacked tensor per size (`device_pixels.decode_groups`)
    fit      to the model's input square, uint8 NHWC, one resize per size, the sizes one
             after another (`device_pixels.fit_groups`)
    forward  the engine's graph (or eager module), outputs left on the device
    outputs  copied back into pinned memory and waited for: the batch's answer, its rows put
             back in the batch's order in one scatter

A model may reduce its outputs on the device before the copy back (`DevicePost`: the detector
keeps each image's best-scored anchors, a few KB, not its whole dense output): queued in
forward right after the engine's graph, on its stream; outputs copies back what it made.

Where the prep processes decoded on the CPU (`HostStages`): upload, forward, outputs. What a
batch carries from stage to stage is in its `Work.values` (device tensors, handed over: one
per size, never one per image) and `Work.host`; a batch none of whose images decoded fails
at `decode` (the Batcher then splits it, as it does any failed batch). Every step works per
batch: a torch call releases the GIL, so a stage's calls stay a handful a batch, whatever its
length (tests/workers/device/test_torch_calls.py counts them).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kiln.app.core.errors import InputError
from kiln.workers.device import decoders
from kiln.workers.device import pixels as device_pixels
from kiln.workers.device.decoders import JpegDecoder
from kiln.workers.device.stages import (
    CpuStreams,
    CudaStreams,
    DeviceStages,
    Stage,
    Streams,
    Work,
)

if TYPE_CHECKING:
    from kiln.app.catalog.model_spec import Preprocessing


@runtime_checkable
class DeviceFeeds(Protocol):
    """An engine that takes feeds already on its device (the torch engine). Image predictors
    decode and fit a batch there (`device_pixels`) on the engine's stream and run it.

    Declared here, by the device path that needs it, not in `engines/base.py`: the torch
    engine matches it structurally, so the device room imports no engine."""

    device: Any  # a torch.device: where the feeds are made

    def on_stream(self) -> AbstractContextManager[None]:
        """This runner thread's stream, and the device as the default for new tensors."""
        ...

    def infer_tensors(self, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """`infer` for device tensors made inside `on_stream()`: host arrays out."""
        ...

    def forward_tensors(self, tensors: Mapping[str, Any]) -> list[Any]:
        """The forward half of `infer_tensors`, queued on the current stream, nothing waited
        for: device outputs of the batch's rows (the device stages' forward stage)."""
        ...

    def outputs_to_host(self, values: list[Any], rows: int) -> dict[str, np.ndarray]:
        """The other half: `forward_tensors`' outputs copied back on the current stream, and
        waited for (the device stages' last stage)."""
        ...


@dataclass(frozen=True)
class DeviceOptions:
    """How an image model feeds a GPU engine (`Settings`: device_pipeline, jpeg_decoder,
    decode_threads)."""

    staged: bool = True
    decoder: str = "auto"
    decode_threads: int = 2


DEFAULT_OPTIONS = DeviceOptions()


@dataclass(frozen=True)
class DeviceAnswer:
    """A batch's answer: the engine's first output with a row per row of the batch (zeros
    where the image failed), the failures by row, and the fits made: per size group, its
    rows and their fit (`{"fit": Letterbox | Squash}`, `{}` for a crop)."""

    output: np.ndarray
    failed: dict[int, Exception]
    fits: list[tuple[np.ndarray, dict[str, Any]]]

    @property
    def good(self) -> list[int]:
        """The rows that decoded, in order."""
        return sorted(int(row) for rows, _meta in self.fits for row in rows)


def decode_rows(
    rows: list[tuple[Any, Any]], device: Any, max_pixels: int, decoder: JpegDecoder | None
) -> tuple[list[device_pixels.Group], dict[int, InputError]]:
    """The rows' images decoded on `device`, a stack per size, and the failures by row.
    Raises when none decoded (one row: its own error)."""
    groups, failed = device_pixels.decode_groups(
        [data for data, _header in rows], device, max_pixels=max_pixels,
        headers=[header for _data, header in rows], decoder=decoder,
        nvjpeg=True if decoder is not None else None,  # the device stand-in's is on meta
    )  # fmt: skip
    if not groups:  # nothing to run: the Batcher splits the batch, each row its error
        raise failed[0] if len(rows) == 1 else InputError("No image of the batch decoded.")
    return groups, failed


def answer(rows: int, output: np.ndarray, failed: dict[int, InputError], order: np.ndarray,
           fits: list[tuple[np.ndarray, dict[str, Any]]]) -> DeviceAnswer:  # fmt: skip
    """The batch's answer from the engine's output for its fitted rows (`order`: the batch's
    row of each), in one scatter (none when every row decoded, in order)."""
    if len(order) == rows and np.array_equal(order, np.arange(rows)):
        return DeviceAnswer(output, dict(failed), fits)
    full = np.zeros((rows, *output.shape[1:]), dtype=output.dtype)
    full[order] = output
    return DeviceAnswer(full, dict(failed), fits)


class DevicePost(Protocol):
    """A model's outputs made smaller on the engine's device before the copy back (torch ops,
    the same on CUDA, on the CPU in tests and on the stand-in's meta device)."""

    def on_device(self, outputs: list[Any], whole: bool = False) -> list[Any]:
        """The engine's outputs → what crosses back (`whole`: nothing cut for size)."""
        ...

    def cut_short(self, host: np.ndarray) -> bool:
        """Whether the copy back left out something the answer needs (then `on_device` runs
        again, `whole`, on the same outputs)."""
        ...


def posted(engine: DeviceFeeds, outputs: list[Any], post: DevicePost | None) -> list[Any]:
    """The forward's outputs after the model's device step, queued after them."""
    if post is None:
        return outputs
    reduced = post.on_device(outputs)
    charge = getattr(engine, "post_processed", None)  # the device stand-in's clock
    return charge(outputs, reduced) if charge is not None else reduced


def copied_back(engine: DeviceFeeds, outputs: list[Any], raw: list[Any] | None,
                post: DevicePost | None, rows: int) -> np.ndarray:  # fmt: skip
    """The first output on the host; taken again whole where the device step cut it short."""
    host = next(iter(engine.outputs_to_host(outputs, rows).values()))
    if post is not None and raw is not None and post.cut_short(host):
        again = engine.outputs_to_host(post.on_device(raw, whole=True), rows)
        host = next(iter(again.values()))
    return host


class _Forward:
    """The stages all device stages end with: the engine's forward, outputs left on the
    device (after the model's `post`, if any); then the copy back, waited for."""

    engine: DeviceFeeds
    input_name: str
    post: DevicePost | None = None

    def forward(self, work: Work) -> None:
        pixels = work.values.pop("pixels")
        outputs = self.engine.forward_tensors({self.input_name: pixels})
        if self.post is not None:  # kept on the device for a copy back cut short
            work.values["raw"] = outputs
        work.values["outputs"] = posted(self.engine, outputs, self.post)

    def _host(self, work: Work, rows: int) -> np.ndarray:
        values = work.values
        raw = values.pop("raw", None)
        return copied_back(self.engine, values.pop("outputs"), raw, self.post, rows)


class HostStages(_Forward):
    """Batches the prep processes decoded and fitted (gathered from their slots into the
    caller's pinned staging buffer): upload → forward → outputs; `device_stages.run(pixels)` →
    the engine's first output. The caller's buffer is not touched again before the answer
    comes, and by then its upload is done."""

    def __init__(self, name: str, engine: DeviceFeeds, input_name: str,
                 post: DevicePost | None = None) -> None:  # fmt: skip
        self.engine, self.input_name, self.post = engine, input_name, post
        stages = [Stage("upload", self.upload), Stage("forward", self.forward),
                  Stage("outputs", self.outputs)]  # fmt: skip
        self.device_stages = DeviceStages(f"{name}-host", stages, _streams(engine))

    def upload(self, work: Work) -> None:
        pixels = work.payload
        tensor = _torch().from_numpy(pixels)
        work.values["pixels"] = tensor.to(self.engine.device, non_blocking=True)
        work.host["rows"] = len(pixels)

    def outputs(self, work: Work) -> None:
        work.result = self._host(work, work.host["rows"])

    def close(self) -> None:
        self.device_stages.close()


def _on_cuda(engine: DeviceFeeds) -> bool:
    return getattr(engine.device, "type", str(engine.device)) == "cuda"


def _streams(engine: DeviceFeeds) -> Streams:
    own = getattr(engine, "streams", None)  # the device stand-in's (engines/standin.py)
    if own is not None:
        return own()  # type: ignore[no-any-return]
    return CudaStreams(_torch(), engine.device) if _on_cuda(engine) else CpuStreams()


class ImageStages(_Forward):
    """The four stages for one model on one engine; `device_stages.run(rows)` → `DeviceAnswer`.
    `decoder` and `streams` (default: the GPU's decoder and streams on a CUDA engine, Pillow
    and none elsewhere) are given by a stand-in device and by the tests."""

    def __init__(
        self, name: str, engine: DeviceFeeds, input_name: str, pre: Preprocessing,
        max_pixels: int, options: DeviceOptions, *, decoder: JpegDecoder | None = None,
        streams: Streams | None = None, post: DevicePost | None = None,
    ) -> None:  # fmt: skip
        self.engine, self.input_name, self.pre, self.post = engine, input_name, pre, post
        self.device, self.max_pixels = engine.device, max_pixels
        decoder = decoder or getattr(engine, "jpeg_decoder", None)  # a stand-in's own
        if decoder is None and _on_cuda(engine):
            decoder = decoders.jpeg_decoder(options.decoder, str(engine.device))
        self.decoder = decoder
        concurrent = self.decoder is not None and self.decoder.concurrent
        threads = options.decode_threads if concurrent else 1
        stages = [
            Stage("decode", self.decode, threads),
            Stage("fit", self.fit),
            Stage("forward", self.forward),
            Stage("outputs", self.outputs),
        ]
        self.device_stages = DeviceStages(f"{name}-device", stages, streams or _streams(engine))

    @property
    def decoder_name(self) -> str:
        return self.decoder.name if self.decoder is not None else "pillow"

    def decode(self, work: Work) -> None:
        rows = work.payload
        groups, failed = decode_rows(rows, self.device, self.max_pixels, self.decoder)
        work.values["images"] = [group.pixels for group in groups]  # handed over: one a size
        work.host.update(groups=groups, failed=failed, rows=len(rows))

    def fit(self, work: Work) -> None:
        del work.values["images"]  # the groups hold them
        fitted = device_pixels.fit_groups(work.host.pop("groups"), self.pre, self.device)
        work.values["pixels"] = fitted.pixels
        work.host.update(order=fitted.order, fits=fitted.fits)

    def outputs(self, work: Work) -> None:
        host = work.host
        output = self._host(work, len(host["order"]))
        work.result = answer(host["rows"], output, host["failed"], host["order"], host["fits"])

    def close(self) -> None:
        self.device_stages.close()


def _torch() -> Any:
    import torch

    return torch
