"""What every registered ONNX image model shares (the classify, embed and detect families):
an `input_size` square made as its spec declares (centre crop, squash or letterbox, with its
resize filter), normalised on the engine's device (channel order, pixel range, mean and std,
layout, dtype), and one output tensor with a row per image. Each family keeps what differs:
how it reads that row.

On the PyTorch CUDA engine with nvJPEG, images are decoded, fitted and normalised on the GPU
for the whole batch (`device_images`): `prepare` only checks the header on the task thread, and
an image that fails to decode fails its own item (`_raise_if_failed` in each family's finish).
Everywhere else the CPU path below runs."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

import numpy as np

from kiln.app.core.errors import InputError
from kiln.app.model_spec import ImageModelSpec, Preprocessing
from kiln.workers.engines.base import Engine
from kiln.workers.models import device_images
from kiln.workers.models.base import Prepared
from kiln.workers.preprocess import decode_image, fit_image, fit_size, normalize, stack


class ImageModelPipeline:
    """The `Pipeline` half shared by registered image models; subclasses add `infer` (usually
    `rows` → `_run` → scores or vectors) and `finish`."""

    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads
    kind = "classify"  # whose defaults a stored spec's missing fields take

    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        self.name = name
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.declared = ImageModelSpec.from_dict(spec)
        self.pre = self.declared.preprocessing(self.kind)
        self.size = self.pre.input_size
        self.max_pixels = max_pixels
        self.input_name = engine.inputs[0].name
        # A model that takes half-precision input gets it straight from `normalize`.
        self.input_dtype = "float16" if engine.inputs[0].dtype == "float16" else "float32"
        self.device = device_decoding(engine, self.pre)  # None: decode on the CPU

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        if self.device is not None:  # the batch decodes on the GPU: check what is cheap here
            device_images.read_header(data, max_pixels=self.max_pixels)
            return Prepared(np.frombuffer(data, dtype=np.uint8), {})
        # JPEGs decode straight to the smallest DCT scale that still covers the resize.
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=self._resized)
        pixels, placement = fit_image(decoded, self.pre)
        return Prepared(pixels, {} if placement is None else {"fit": placement})

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        return fit_size(self.pre, width, height)

    def _normalize(self, xp: ModuleType, batch: Any) -> Any:
        pre = self.pre
        return normalize(
            xp,
            batch,
            mean=pre.mean,
            std=pre.std,
            scale=pre.scale,
            layout=pre.layout,
            dtype=self.input_dtype,
            channel_order=pre.channel_order,
        )

    def _output(self, rows: Sequence[Prepared]) -> np.ndarray:
        """The engine's first output for `rows`, as the engine gives it."""
        if self.device is not None:
            return self._output_on_device(rows)
        pixels = stack([r.pixels for r in rows])  # uint8: 4x less to copy to a GPU than floats
        outputs = self.engine.infer({self.input_name: pixels}, {self.input_name: self._normalize})
        return next(iter(outputs.values()))

    def _output_on_device(self, rows: Sequence[Prepared]) -> np.ndarray:
        """Decode, fit and normalise the batch on the engine's device; a row whose image does
        not decode keeps its error in `meta` and gets a row of zeros."""
        datas = [r.pixels.tobytes() for r in rows]
        images = device_images.decode_batch(datas, self.device, max_pixels=self.max_pixels)
        good = [i for i, image in enumerate(images) if not isinstance(image, InputError)]
        if not good:  # nothing to run: the Batcher splits the batch, each row gets its error
            raise images[0] if len(rows) == 1 else InputError("No image of the batch decoded.")
        for row, image in zip(rows, images, strict=True):
            if isinstance(image, InputError):
                row.meta["error"] = image
        batch, metas = device_images.fit_batch(
            [images[i] for i in good], self.pre, dtype=self.input_dtype
        )
        for i, meta in zip(good, metas, strict=True):
            rows[i].meta.update(meta)
        engine = cast(Any, self.engine)  # the torch engine: it takes device tensors
        output = next(iter(engine.infer_tensors({self.input_name: batch}).values()))
        full = np.zeros((len(rows), *output.shape[1:]), dtype=output.dtype)
        full[good] = output
        return full

    @staticmethod
    def _raise_if_failed(row: Prepared) -> None:
        """The image of this row did not decode on the device: fail its item alone."""
        error = row.meta.get("error")
        if error is not None:
            raise error

    def _run(self, rows: Sequence[Prepared]) -> np.ndarray:
        """The engine's first output for `rows`, one flat row per image."""
        return self._output(rows).reshape(len(rows), -1)

    def close(self) -> None:
        """Nothing beyond the engine to release."""


def device_decoding(engine: Engine, pre: Preprocessing) -> Any | None:
    """The torch device to decode and fit images on, or None: only with the PyTorch CUDA
    engine, where torchvision decodes JPEGs with nvJPEG, and a resize filter torch has."""
    if not engine.backend.startswith("torch:cuda") or not device_images.supports(pre):
        return None
    device = getattr(engine, "device", None)
    if device is None or not device_images.nvjpeg_available(str(device)):
        return None
    return device
