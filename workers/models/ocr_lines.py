"""Reading detected lines: crops, strips for the angle classifier and the recogniser, and the
batch functions that run those engines over strips from many images at once.

A strip is a crop resized to the model's height (uint8, on the task thread). Batches pad
strips in width with normalised zeros, as rapidocr does. rapidocr pads a recognition batch to
its widest strip, which makes a line's scores depend on its neighbours (the model attends over
the whole width); here each strip has its own padded width — its width alone, rounded up to a
bucket — and only strips of one bucket share an engine call, so an image reads the same
whatever else is in flight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import cv2
import numpy as np

from kiln.workers.engines.base import Engine
from kiln.workers.models.ocr_config import OcrConfig
from kiln.workers.prep.pixels import normalize

REC_BUCKET = 160  # padded widths are multiples of this (20 CTC steps): few shapes, little waste
# The widest recognition strip (a 2,000 px line 20 px tall): longer lines are squeezed into it,
# as rapidocr squeezes a strip into its batch's width. TensorRT needs the range ahead of time.
REC_MAX_WIDTH = 30 * REC_BUCKET
HALF = (0.5, 0.5, 0.5)  # PP-OCR's cls and rec normalise pixels to [-1, 1]


@dataclass(frozen=True)
class Strip:
    """One line resized to the model's height; `width` is what it is padded to."""

    pixels: np.ndarray  # uint8 HWC, BGR
    width: int


# Per strip: the recogniser's best class and its probability at each time step.
Reading = tuple[np.ndarray, np.ndarray]
Axes = tuple[tuple[int, int, int, int], ...]  # dynamic (axis, min, opt, max), as engines take


def strip_axes(height: int, min_width: int, max_width: int) -> Axes:
    """The NCHW ranges of a strip model's input: a fixed height, widths tuned for the minimum."""
    return (2, height, height, height), (3, min_width, min_width, max_width)


def group_indices(keys: Sequence[Hashable]) -> list[list[int]]:
    """Indices of equal keys, in first-seen order: rows that can share one tensor."""
    groups: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def padded_normalizer(valid: np.ndarray) -> Callable[[ModuleType, Any], Any]:
    """uint8 NHWC strips → float32 NCHW in [-1, 1], zero right of each strip's `valid`
    columns (rapidocr pads after normalising), on the engine's `xp`."""

    def prepare(xp: ModuleType, batch: Any) -> Any:
        out = normalize(xp, batch, mean=HALF, std=HALF)
        columns = xp.arange(batch.shape[2])[None, :] < xp.asarray(valid)[:, None]
        return out * columns[:, None, None, :]

    return prepare


def run_strips(engine: Engine, rows: Sequence[Strip]) -> list[np.ndarray]:
    """The engine's first output for each strip; strips of one padded width share a call."""
    name = engine.inputs[0].name
    outputs: list[np.ndarray] = [np.empty(0)] * len(rows)
    for group in group_indices([r.width for r in rows]):
        strips = [rows[i] for i in group]
        height, width = strips[0].pixels.shape[0], strips[0].width
        batch = np.zeros((len(strips), height, width, 3), dtype=np.uint8)
        for k, strip in enumerate(strips):
            batch[k, :, : strip.pixels.shape[1]] = strip.pixels
        valid = np.array([s.pixels.shape[1] for s in strips])
        result = engine.infer({name: batch}, {name: padded_normalizer(valid)})
        for i, output in zip(group, next(iter(result.values())), strict=True):
            outputs[i] = output
    return outputs


def resized(crop: np.ndarray, height: int, width: int) -> np.ndarray:
    """The crop at `height`, its aspect kept but at most `width` wide (rapidocr's rounding)."""
    target = min(width, math.ceil(height * crop.shape[1] / crop.shape[0]))
    return np.asarray(cv2.resize(crop, (target, height)), dtype=np.uint8)


class LineReader:
    """The CPU steps around the classifier and recogniser engines, and their batch functions
    (called by the predictor's inner Batchers)."""

    def __init__(self, config: OcrConfig, cls_engine: Engine, rec_engine: Engine) -> None:
        from rapidocr_onnxruntime.ch_ppocr_cls.utils import ClsPostProcess
        from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode
        from rapidocr_onnxruntime.main import RapidOCR

        self.config = config
        self.cls_engine = cls_engine
        self.rec_engine = rec_engine
        self._angles: Any = ClsPostProcess(list(config.cls_labels))
        self._ctc: Any = CTCLabelDecode(character=characters(config.rec_model))
        self._crop_lines: Any = RapidOCR.get_crop_img_list  # its `self` is never used

    # --- task threads --------------------------------------------------------------------

    def crops(self, image: np.ndarray, boxes: np.ndarray) -> list[np.ndarray]:
        """Each box cut out straight (perspective), tall ones turned: rapidocr's crops."""
        return list(self._crop_lines(None, image, boxes))

    def cls_strip(self, crop: np.ndarray) -> Strip:
        width = self.config.cls_width
        return Strip(resized(crop, self.config.cls_height, width), width)

    def upright(self, crop: np.ndarray, angle: tuple[str, float]) -> np.ndarray:
        """The crop turned 180° when the classifier is confident it is upside down."""
        label, score = angle
        if "180" in label and score > self.config.cls_thresh:
            return np.asarray(cv2.rotate(crop, cv2.ROTATE_180))
        return crop

    def rec_strip(self, crop: np.ndarray) -> Strip:
        """The height the recogniser takes; padded to this crop's own width (as rapidocr pads
        a crop alone: at least `rec_width`) rounded up to a bucket."""
        height = self.config.rec_height
        ratio = max(self.config.rec_width / height, crop.shape[1] / crop.shape[0])
        own = min(int(height * ratio), REC_MAX_WIDTH)
        return Strip(resized(crop, height, own), math.ceil(own / REC_BUCKET) * REC_BUCKET)

    def text(self, reading: Reading) -> tuple[str, float]:
        """CTC decoding (repeats merged, blanks dropped) and the mean confidence."""
        indices, probabilities = reading
        (text, score), *_ = self._ctc.decode(
            indices[np.newaxis], probabilities[np.newaxis], is_remove_duplicate=True
        )
        return str(text), float(score)

    # --- runner threads (inner Batchers) ---------------------------------------------------

    def classify(self, rows: Sequence[Strip]) -> list[tuple[str, float]]:
        probabilities = np.stack(run_strips(self.cls_engine, rows))
        return [(str(label), float(score)) for label, score in self._angles(probabilities)]

    def recognise(self, rows: Sequence[Strip]) -> list[Reading]:
        # Only the best class per step leaves the runner, not the 6,625-way distribution.
        return [(p.argmax(axis=-1), p.max(axis=-1)) for p in run_strips(self.rec_engine, rows)]


def characters(rec_model: Path) -> list[str]:
    """The recogniser's alphabet, stored in the ONNX file's metadata (as rapidocr reads it)."""
    import onnx

    model = onnx.load(str(rec_model), load_external_data=False)
    metadata: dict[str, str] = {p.key: p.value for p in model.metadata_props}
    if "character" not in metadata:
        raise RuntimeError(f"{rec_model} has no 'character' metadata: not a PP-OCR recogniser.")
    return metadata["character"].splitlines()
