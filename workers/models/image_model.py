"""What every registered ONNX image model shares (the classify, embed and detect families):
an `input_size` square made as its spec declares (centre crop, squash or letterbox, with its
resize filter), normalised on the engine's device (channel order, pixel range, mean and std,
layout, dtype), and one output tensor with a row per image. Each family keeps what differs:
how it reads that row.

The prep processes decode and fit each image into the model's slot (`workers/prep/images.py`);
a batch arrives here as uint8 pixels and is normalised where the engine keeps it. On the
PyTorch CUDA engine with nvJPEG, images are decoded, fitted and normalised on the GPU for the
whole batch (`device_pixels`): prep only checks the header, and an image that fails to decode
fails its own row."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.app.core.errors import InputError
from kiln.app.model_spec import ImageModelSpec, Preprocessing
from kiln.workers.engines.base import Closable, DeviceFeeds, Engine, HostStaging
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.models.base import Answers, Batch
from kiln.workers.prep import device_pixels
from kiln.workers.prep.images import FIT_WIDTH, placement_row
from kiln.workers.prep.slots import SlotLayout
from kiln.workers.prep.spec import PrepSpec, prep_spec


class ImageModelPipeline:
    """The `Pipeline` half shared by registered image models; subclasses add `infer` (usually
    `_run(batch)` → scores or vectors → columns)."""

    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads
    kind = "classify"  # whose defaults a stored spec's missing fields take

    def __init__(
        self,
        name: str,
        engine: Engine,
        spec: dict[str, Any],
        *,
        max_pixels: int,
        gpu_decode: bool = True,
    ) -> None:
        self.name = name
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.declared = ImageModelSpec.from_dict(spec)
        self.pre = self.declared.preprocessing(self.kind)
        self.size = self.pre.input_size
        self.normalization = Normalization.of(self.pre)
        self.max_pixels = max_pixels
        self.input_name = engine.inputs[0].name
        # A model that takes half-precision input gets it straight from `normalize`.
        self.input_dtype = "float16" if engine.inputs[0].dtype == "float16" else "float32"
        # A GPU engine given the normalisation takes uint8 pixels and normalises them itself.
        self.engine_normalizes = engine.inputs[0].dtype == "uint8"
        # None: the prep processes decode on the CPU
        self.device = device_decoding(engine, self.pre) if gpu_decode else None
        self.prep = self._prep_spec()

    def _prep_spec(self) -> PrepSpec:
        if self.device is not None:  # the batch decodes on the GPU: prep checks headers only
            return prep_spec(
                "kiln.workers.prep.images:HeaderPrep",
                {"max_pixels": self.max_pixels},
                meta_width=FIT_WIDTH,  # the fits the device makes are recorded per batch
            )
        return prep_spec(
            "kiln.workers.prep.images:ImagePrep",
            {"preprocessing": self.pre, "max_pixels": self.max_pixels},
            layout=SlotLayout((self.size, self.size, 3)),
            meta_width=FIT_WIDTH,
        )

    def _normalize(self, xp: Any, batch: Any) -> Any:
        """The model's normalisation on NumPy or CuPy (a CPU engine's `prepare`)."""
        return self.normalization(xp, batch, self.input_dtype)

    def _output(self, batch: Batch) -> tuple[np.ndarray, dict[int, Exception]]:
        """The engine's first output for the batch, and the rows that failed before it (an
        image the GPU could not decode gets a row of zeros and its error)."""
        if self.device is not None:
            return self._output_on_device(batch)
        assert batch.pixels is not None  # uint8: 4x less to copy to a GPU than floats
        steps = {} if self.engine_normalizes else {self.input_name: self._normalize}
        outputs = self.engine.infer({self.input_name: batch.pixels}, steps)
        return next(iter(outputs.values())), {}

    def pixel_buffer(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """Where a batch's pixels may be gathered: the engine's own (pinned) staging buffer,
        so they are not copied again on the way to the device; None: anywhere."""
        engine = self.engine
        if isinstance(engine, HostStaging) and self.engine_normalizes and self.device is None:
            return engine.host_buffer(shape)
        return None

    def _output_on_device(self, batch: Batch) -> tuple[np.ndarray, dict[int, Exception]]:
        """Decode and fit the batch on the engine's device, on its runner's stream (where the
        engine then normalises and runs it); the rows that failed to decode, apart."""
        rows = batch.objects or []
        engine = self.engine
        assert isinstance(engine, DeviceFeeds)  # the only engines `device_decoding` chooses
        with engine.on_stream():
            images = device_pixels.decode_batch(
                [data for data, _header in rows], self.device, max_pixels=self.max_pixels,
                headers=[h for _d, h in rows],
            )  # fmt: skip
            failed: dict[int, Exception] = {
                i: image for i, image in enumerate(images) if isinstance(image, InputError)
            }
            good = [i for i in range(len(images)) if i not in failed]
            if not good:  # nothing to run: the Batcher splits the batch, each row its error
                raise failed[0] if len(rows) == 1 else InputError("No image of the batch decoded.")
            pixels, metas = device_pixels.fit_batch([images[i] for i in good], self.pre)
            output = next(iter(engine.infer_tensors({self.input_name: pixels}).values()))
        full = np.zeros((len(rows), *output.shape[1:]), dtype=output.dtype)
        full[good] = output
        if batch.meta is not None:  # the fits the device made, as the CPU path records them
            for i, meta in zip(good, metas, strict=True):
                if "fit" in meta:
                    batch.meta[i] = placement_row(meta["fit"])
        return full, failed

    def _run(self, batch: Batch) -> tuple[np.ndarray, dict[int, Exception]]:
        """The engine's first output, one flat row per image, and the rows that failed."""
        output, failed = self._output(batch)
        return output.reshape(len(batch), -1), failed

    def finish(self, answers: Answers) -> Answers:
        return answers  # everything was answered per batch

    def close(self) -> None:
        """The engine's device memory (a torch engine's CUDA graphs first, then its module)."""
        if isinstance(self.engine, Closable):
            self.engine.close()


def device_decoding(engine: Engine, pre: Preprocessing) -> Any | None:
    """The torch device to decode and fit images on, or None: only with the PyTorch CUDA
    engine, where torchvision decodes JPEGs with nvJPEG, and a resize filter torch has."""
    if not engine.backend.startswith("torch:cuda") or not device_pixels.supports(pre):
        return None
    if engine.inputs[0].dtype != "uint8":  # the engine normalises what the device fits
        return None
    if not isinstance(engine, DeviceFeeds):
        return None
    return engine.device if device_pixels.nvjpeg_available(str(engine.device)) else None
