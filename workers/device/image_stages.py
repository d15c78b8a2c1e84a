"""An image model's batches on the GPU as overlapped stages (`device/stages.py`). Where the GPU
decodes (`ImageStages`):

    decode   the JPEGs with the GPU's decoder (`device/decoders.py`), the rest with Pillow;
             one thread per decoder state (nvImageCodec: `KILN_DECODE_THREADS`)
    fit      to the model's input square, uint8 NHWC (`device_pixels.fit_batch`)
    forward  the engine's graph (or eager module), outputs left on the device
    outputs  copied back into pinned memory and waited for: the batch's answer

Where the prep processes decoded on the CPU (`HostStages`): upload, forward, outputs. What a
batch carries from stage to stage is in its `Work.values`; a batch none of whose images
decoded fails at `decode` (the Batcher then splits it, as it does any failed batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.app.core.errors import InputError
from kiln.workers.device import decoders
from kiln.workers.device import pixels as device_pixels
from kiln.workers.device.decoders import JpegDecoder
from kiln.workers.device.stages import (
    CpuStreams,
    CudaStreams,
    Stage,
    StagedPipeline,
    Streams,
    Work,
)
from kiln.workers.engines.base import DeviceFeeds

if TYPE_CHECKING:
    from kiln.app.model_spec import Preprocessing


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
    """A batch's answer: the engine's first output with a row per image (zeros where the
    image failed), the failures by row, and the fits made (rows that decoded, in order)."""

    output: np.ndarray
    failed: dict[int, Exception]
    good: list[int]
    metas: list[dict[str, Any]]


def decode_rows(
    rows: list[tuple[Any, Any]], device: Any, max_pixels: int, decoder: JpegDecoder | None
) -> tuple[list[Any], dict[int, Exception], list[int]]:
    """The rows' images decoded on `device`: those that decoded, the failures by row, and
    which rows decoded. Raises when none did (one row: its own error)."""
    images = device_pixels.decode_batch(
        [data for data, _header in rows], device, max_pixels=max_pixels,
        headers=[header for _data, header in rows], decoder=decoder,
        nvjpeg=True if decoder is not None else None,  # the device stand-in's is on meta
    )  # fmt: skip
    failed: dict[int, Exception] = {
        i: image for i, image in enumerate(images) if isinstance(image, InputError)
    }
    good = [i for i in range(len(images)) if i not in failed]
    if not good:  # nothing to run: the Batcher splits the batch, each row its error
        raise failed[0] if len(rows) == 1 else InputError("No image of the batch decoded.")
    return [images[i] for i in good], failed, good


def answer(rows: int, output: np.ndarray, failed: dict[int, Exception], good: list[int],
           metas: list[dict[str, Any]]) -> DeviceAnswer:  # fmt: skip
    full = np.zeros((rows, *output.shape[1:]), dtype=output.dtype)
    full[good] = output
    return DeviceAnswer(full, failed, good, metas)


class _Forward:
    """The stages every device pipeline ends with: the engine's forward, outputs left on the
    device; then the copy back, waited for."""

    engine: DeviceFeeds
    input_name: str

    def forward(self, work: Work) -> None:
        pixels = work.values.pop("pixels")
        work.values["outputs"] = self.engine.forward_tensors({self.input_name: pixels})

    def _host(self, work: Work, rows: int) -> np.ndarray:
        host = self.engine.outputs_to_host(work.values.pop("outputs"), rows)
        return next(iter(host.values()))


class HostStages(_Forward):
    """Batches the prep processes decoded and fitted (gathered from their slots into the
    caller's pinned staging buffer): upload → forward → outputs; `pipeline.run(pixels)` →
    the engine's first output. The caller's buffer is not touched again before the answer
    comes, and by then its upload is done."""

    def __init__(self, name: str, engine: DeviceFeeds, input_name: str) -> None:
        self.engine, self.input_name = engine, input_name
        stages = [Stage("upload", self.upload), Stage("forward", self.forward),
                  Stage("outputs", self.outputs)]  # fmt: skip
        self.pipeline = StagedPipeline(f"{name}-host", stages, _streams(engine))

    def upload(self, work: Work) -> None:
        pixels = work.payload
        tensor = _torch().from_numpy(pixels)
        work.values.update(pixels=tensor.to(self.engine.device, non_blocking=True),
                           rows=len(pixels))  # fmt: skip

    def outputs(self, work: Work) -> None:
        work.result = self._host(work, work.values["rows"])

    def close(self) -> None:
        self.pipeline.close()


def _on_cuda(engine: DeviceFeeds) -> bool:
    return getattr(engine.device, "type", str(engine.device)) == "cuda"


def _streams(engine: DeviceFeeds) -> Streams:
    own = getattr(engine, "streams", None)  # the device stand-in's (device/standin.py)
    if own is not None:
        return own()  # type: ignore[no-any-return]
    return CudaStreams(_torch(), engine.device) if _on_cuda(engine) else CpuStreams()


class ImageStages(_Forward):
    """The four stages for one model on one engine; `pipeline.run(rows)` → `DeviceAnswer`."""

    def __init__(
        self, name: str, engine: DeviceFeeds, input_name: str, pre: Preprocessing,
        max_pixels: int, options: DeviceOptions,
    ) -> None:  # fmt: skip
        self.engine, self.input_name, self.pre = engine, input_name, pre
        self.device, self.max_pixels = engine.device, max_pixels
        gpu = _on_cuda(engine)
        self.decoder: JpegDecoder | None = getattr(engine, "jpeg_decoder", None)  # a stand-in's
        if self.decoder is None and gpu:
            self.decoder = decoders.jpeg_decoder(options.decoder, str(engine.device))
        concurrent = self.decoder is not None and self.decoder.concurrent
        threads = options.decode_threads if concurrent else 1
        stages = [
            Stage("decode", self.decode, threads),
            Stage("fit", self.fit),
            Stage("forward", self.forward),
            Stage("outputs", self.outputs),
        ]
        self.pipeline = StagedPipeline(f"{name}-device", stages, _streams(engine))

    @property
    def decoder_name(self) -> str:
        return self.decoder.name if self.decoder is not None else "pillow"

    def decode(self, work: Work) -> None:
        rows = work.payload
        images, failed, good = decode_rows(rows, self.device, self.max_pixels, self.decoder)
        work.values.update(images=images, failed=failed, good=good, rows=len(rows))

    def fit(self, work: Work) -> None:
        pixels, metas = device_pixels.fit_batch(work.values.pop("images"), self.pre)
        work.values.update(pixels=pixels, metas=metas)

    def outputs(self, work: Work) -> None:
        good = work.values["good"]
        output = self._host(work, len(good))
        v = work.values
        work.result = answer(v["rows"], output, v["failed"], good, v["metas"])

    def close(self) -> None:
        self.pipeline.close()


def _torch() -> Any:
    import torch

    return torch
