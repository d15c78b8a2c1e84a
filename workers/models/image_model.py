"""What every registered ONNX image model shares (the classify, embed and detect families):
an `input_size` square made as its spec declares (centre crop, squash or letterbox, with its
resize filter), normalised on the engine's device (channel order, pixel range, mean and std,
layout, dtype), and one output tensor with a row per image. Each family keeps what differs:
how it reads that row.

The prep processes decode and fit each image into the model's slot (`workers/prep/images.py`);
a batch arrives here as uint8 pixels and is normalised where the engine keeps it. On the
PyTorch CUDA engine with a GPU JPEG decoder, images are decoded, fitted and normalised on the
GPU for the whole batch (`workers/device/`), as overlapped stages: prep only checks the header,
and an image that fails to decode fails its own row."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.app.catalog.model_spec import ImageModelSpec, Preprocessing
from kiln.workers.device import decoders
from kiln.workers.device import pixels as device_pixels
from kiln.workers.device.image_stages import (
    DEFAULT_OPTIONS,
    DeviceAnswer,
    DeviceFeeds,
    DeviceOptions,
    DevicePost,
    HostStages,
    ImageStages,
    answer,
    copied_back,
    decode_rows,
    posted,
)
from kiln.workers.engines.base import Closable, Engine, HostStaging
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.models.base import Answers, Batch
from kiln.workers.prep.images import FIT_WIDTH, placement_row
from kiln.workers.prep.slots import SlotLayout
from kiln.workers.prep.spec import PrepSpec, prep_spec


class ImageModelPredictor:
    """The `Predictor` half shared by registered image models; subclasses add `infer` (usually
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
        device_options: DeviceOptions = DEFAULT_OPTIONS,
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
        self.options = device_options
        self.device = device_decoding(engine, self.pre, device_options) if gpu_decode else None
        self.stages: ImageStages | None = None
        self.post = post = self.device_post()
        if self.device is not None and device_options.staged:
            assert isinstance(engine, DeviceFeeds)  # the only engines `device_decoding` takes
            self.stages = ImageStages(
                name, engine, self.input_name, self.pre, max_pixels, device_options, post=post
            )
        self.host_stages: HostStages | None = None
        if self.device is None and device_options.staged and _staged_host(engine):
            assert isinstance(engine, DeviceFeeds)
            self.host_stages = HostStages(name, engine, self.input_name, post)
        # the outputs `_output` gives: the device step's (`device_post`), or the engine's own
        self.posted = post is not None and (self.device is not None or self.host_stages is not None)
        # Batches worth having in flight at once: every stage busy, its queue filled.
        staged = self.stages or self.host_stages
        watch = getattr(engine, "watch", None)  # the device stand-in reports the verdict
        if staged is not None and watch is not None:
            watch(staged.device_stages)
        self.in_flight = staged.device_stages.in_flight if staged is not None else 0
        self.prep = self._prep_spec()

    def _prep_spec(self) -> PrepSpec:
        if self.device is not None:  # the batch decodes on the GPU: prep checks headers only
            return prep_spec(
                "kiln.workers.prep.images:HeaderPrep",
                {"max_pixels": self.max_pixels},
                meta_width=FIT_WIDTH,  # the fits the device makes are recorded per batch
                byte_slots=True,  # each file read in place from shared memory, not pickled
            )
        return prep_spec(
            "kiln.workers.prep.images:ImagePrep",
            {"preprocessing": self.pre, "max_pixels": self.max_pixels},
            layout=SlotLayout((self.size, self.size, 3)),
            meta_width=FIT_WIDTH,
        )

    def device_post(self) -> DevicePost | None:
        """What the engine's device makes of its outputs before they are copied back, where
        the batch runs on a device (a detector's candidates); None: the outputs as they are."""
        return None

    def _normalize(self, xp: Any, batch: Any) -> Any:
        """The model's normalisation on NumPy or CuPy (a CPU engine's `prepare`)."""
        return self.normalization(xp, batch, self.input_dtype)

    def _output(self, batch: Batch) -> tuple[np.ndarray, dict[int, Exception]]:
        """The engine's first output for the batch (after `device_post` where `posted`), and
        the rows that failed before it (an image the GPU could not decode gets a row of zeros
        and its error)."""
        if self.device is not None:
            return self._output_on_device(batch)
        assert batch.pixels is not None  # uint8: 4x less to copy to a GPU than floats
        if self.host_stages is not None:
            return self.host_stages.device_stages.run(batch.pixels), {}
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
        """Decode, fit and run the batch on the engine's device (staged, or one step after
        another on this runner's stream); the rows that failed to decode, apart."""
        rows = batch.objects or []
        done = (
            self.stages.device_stages.run(rows) if self.stages is not None else self._serial(rows)
        )
        if batch.meta is not None:  # the fits the device made, as the CPU path records them
            for group_rows, meta in done.fits:  # one write per size group, not per row
                if "fit" in meta:
                    batch.meta[group_rows] = placement_row(meta["fit"])
        return done.output, done.failed

    def _serial(self, rows: list[tuple[Any, Any]]) -> DeviceAnswer:
        """`KILN_DEVICE_PIPELINE=serial`: each step in turn on this runner's stream."""
        engine = self.engine
        assert isinstance(engine, DeviceFeeds)  # the only engines `device_decoding` takes
        decoder = getattr(engine, "jpeg_decoder", None) or decoders.jpeg_decoder(
            self.options.decoder, str(self.device)
        )  # the device stand-in's own, else the GPU's
        post = self.post
        with engine.on_stream():
            groups, failed = decode_rows(rows, self.device, self.max_pixels, decoder)
            fitted = device_pixels.fit_groups(groups, self.pre, self.device)
            raw = engine.forward_tensors({self.input_name: fitted.pixels})
            outputs = posted(engine, raw, post)
            output = copied_back(engine, outputs, raw, post, len(fitted.order))
        return answer(len(rows), output, failed, fitted.order, fitted.fits)

    def _run(self, batch: Batch) -> tuple[np.ndarray, dict[int, Exception]]:
        """The engine's first output, one flat row per image, and the rows that failed."""
        output, failed = self._output(batch)
        return output.reshape(len(batch), -1), failed

    def finish(self, answers: Answers) -> Answers:
        return answers  # everything was answered per batch

    def close(self) -> None:
        """The stages' threads, then the engine's device memory (a torch engine's CUDA graphs
        first, then its module)."""
        for staged in (self.stages, self.host_stages):
            if staged is not None:
                staged.close()
        if isinstance(self.engine, Closable):
            self.engine.close()


# Engines whose device decodes and fits: PyTorch on CUDA, and the device stand-in (benches).
DEVICE_BACKENDS = ("torch:cuda", "standin:")


def _staged_host(engine: Engine) -> bool:
    """A CUDA torch engine (or the device stand-in) fed uint8 pixels the prep processes
    made: worth staging."""
    return (
        engine.backend.startswith(DEVICE_BACKENDS)
        and engine.inputs[0].dtype == "uint8"
        and isinstance(engine, DeviceFeeds)
    )


def device_decoding(
    engine: Engine, pre: Preprocessing, options: DeviceOptions = DEFAULT_OPTIONS
) -> Any | None:
    """The torch device to decode and fit images on, or None: only with the PyTorch CUDA
    engine, where a GPU JPEG decoder works (`options.decoder`), and a resize filter torch
    has; or with the device stand-in (benches and tests), which brings its own decoder."""
    if not engine.backend.startswith(DEVICE_BACKENDS) or not device_pixels.supports(pre):
        return None
    if engine.inputs[0].dtype != "uint8":  # the engine normalises what the device fits
        return None
    if not isinstance(engine, DeviceFeeds):
        return None
    if getattr(engine, "jpeg_decoder", None) is not None:  # the stand-in's (engines/standin.py)
        return engine.device
    available = device_pixels.nvjpeg_available(str(engine.device), options.decoder)
    return engine.device if available else None
