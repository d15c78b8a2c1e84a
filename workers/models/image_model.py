"""What every registered ONNX image model shares (the classify and embed families): a
centre-cropped square of `input_size` pixels, normalised with the spec's mean and std on the
engine's device, and one output tensor with a row per image. Each family keeps what differs:
how it reads that row."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kiln.app.core.errors import InputError
from kiln.app.model_spec import IMAGENET_MEAN, IMAGENET_STD
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared
from kiln.workers.preprocess import center_crop, decode_image, normalize, resize_side, stack


class ImageModelPipeline:
    """The `Pipeline` half shared by registered image models; subclasses add `infer` (usually
    `rows` → `_run` → scores or vectors) and `finish`."""

    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads
    layout = "NCHW"  # how the engine takes pixels; a family may read it from the spec
    input_dtype = "float32"

    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        self.name = name
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.size = int(spec["input_size"])
        self.mean = tuple(spec.get("mean", IMAGENET_MEAN))
        self.std = tuple(spec.get("std", IMAGENET_STD))
        self.max_pixels = max_pixels
        self.input_name = engine.inputs[0].name

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        # JPEGs decode straight to the smallest DCT scale that still covers the resize.
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=resize_side(self.size))
        return Prepared(center_crop(decoded, self.size))

    def _normalize(self, xp: ModuleType, batch: Any) -> Any:
        return normalize(
            xp, batch, mean=self.mean, std=self.std, layout=self.layout, dtype=self.input_dtype
        )

    def _run(self, rows: Sequence[Prepared]) -> np.ndarray:
        """The engine's first output for `rows`, one flat row per image."""
        pixels = stack([r.pixels for r in rows])  # uint8: 4x less to copy to a GPU than floats
        outputs = self.engine.infer({self.input_name: pixels}, {self.input_name: self._normalize})
        return next(iter(outputs.values())).reshape(len(rows), -1)

    def close(self) -> None:
        """Nothing beyond the engine to release."""
