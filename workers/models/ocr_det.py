"""Text detection around the engine: the working image, the detector's input, DB boxes.

Follows rapidocr's `RapidOCR.__call__` and `TextDetector` step by step, reusing its pure
functions (resizing, letterbox, DB post-processing, reading order) without its ONNX sessions.
One departure: the detector's input has a largest side (`MAX_DET_SIDE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import cv2
import numpy as np

from kiln.app.core.errors import InputError
from kiln.workers.models.ocr_config import OcrConfig
from kiln.workers.prep.pixels import Decoded, normalize

# The detector's longest input side. rapidocr's letterbox bounds wide images at 8 × 736 px;
# a tall thin one (30 × 2000 px) would otherwise grow to 736 × 49,000 px (gigabytes of
# activations), so its short side grows less. TensorRT also needs the range ahead of time.
MAX_DET_SIDE = 5888
# Dynamic (axis, min, opt, max) of the NCHW input: multiples of 32, tuned for landscape photos.
DET_AXES = ((2, 32, 736, MAX_DET_SIDE), (3, 32, 992, MAX_DET_SIDE))


@dataclass(frozen=True)
class Page:
    """The working image (BGR uint8, as PP-OCR was trained) and how to map its points back."""

    image: np.ndarray  # boxes are found in, and lines cropped from, this image
    top: int  # rows of letterbox padding above the content
    scale_x: float  # working pixels → original pixels
    scale_y: float
    width: int  # the original, upright size
    height: int


class Detection:
    """The CPU steps before and after the detector engine, for one image at a time."""

    def __init__(self, config: OcrConfig) -> None:
        # rapidocr is imported here, not at module level: importing it sets up its logging.
        from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess
        from rapidocr_onnxruntime.main import RapidOCR
        from rapidocr_onnxruntime.utils import process_img

        self.config = config
        self._img: Any = process_img
        self._db: Any = DBPostProcess(
            thresh=config.thresh,
            box_thresh=config.box_thresh,
            max_candidates=config.max_candidates,
            unclip_ratio=config.unclip_ratio,
            score_mode=config.score_mode,
            use_dilation=config.use_dilation,
        )
        self._reading_order: Any = RapidOCR.sorted_boxes  # a static method: no instance built

    def page(self, decoded: Decoded) -> Page:
        """rapidocr's `preprocess` and `maybe_add_letterbox`: sides within limits, and thin
        images padded above and below so the detector sees enough rows."""
        image = np.ascontiguousarray(np.asarray(decoded.image)[:, :, ::-1])  # RGB → BGR
        try:
            if max(image.shape[:2]) > self.config.max_side_len:
                image = self._img.reduce_max_side(image, self.config.max_side_len)[0]
            if min(image.shape[:2]) < self.config.min_side_len:
                image = self._img.increase_min_side(image, self.config.min_side_len)[0]
        except self._img.ResizeImgError:
            size = f"{decoded.width}×{decoded.height}"
            raise InputError(f"The image is {size} pixels: too thin to read text from.") from None
        height, width = image.shape[:2]
        top = padding(height, width, self.config)
        if top:
            image = self._img.add_round_letterbox(image, (top, top, 0, 0))
        scale_x, scale_y = decoded.width / width, decoded.height / height
        return Page(image, top, scale_x, scale_y, decoded.width, decoded.height)

    def input(self, page: Page) -> np.ndarray:
        """The detector's uint8 input: sides limited as configured, multiples of 32."""
        height, width = page.image.shape[:2]
        size = det_size(height, width, self.config)
        if min(size) < 1:
            raise InputError(f"The image is {width}×{height} pixels: too small to read text from.")
        return np.asarray(cv2.resize(page.image, size[::-1]), dtype=np.uint8)

    def normalizer(self) -> Any:
        """uint8 NHWC → float32 NCHW with the detector's mean/std, on the engine's `xp`."""
        mean, std = self.config.det_mean, self.config.det_std

        def prepare(xp: ModuleType, batch: Any) -> Any:
            return normalize(xp, batch, mean=mean, std=std)

        return prepare

    def boxes(self, probabilities: np.ndarray, page: Page) -> np.ndarray:
        """One [1, H, W] map → [n, 4, 2] float32 corners (tl, tr, br, bl) in working pixels,
        in reading order (rapidocr's `TextDetector` post-processing and `sorted_boxes`)."""
        shape = page.image.shape[:2]
        found, _ = self._db(probabilities[np.newaxis], shape)
        boxes = [b for b in (_clip(_clockwise(box), shape) for box in found) if _big_enough(b)]
        if not boxes:
            return np.zeros((0, 4, 2), dtype=np.float32)
        return np.array(self._reading_order(np.array(boxes)), dtype=np.float32)


def det_size(height: int, width: int, config: OcrConfig) -> tuple[int, int]:
    """rapidocr's `DetPreProcess.resize` (height, width), its long side capped at
    `MAX_DET_SIDE`."""
    short, long = min(height, width), max(height, width)
    if config.limit_type == "max":
        ratio = min(1.0, config.limit_side_len / long)
    else:
        ratio = max(1.0, config.limit_side_len / short)
    ratio = min(ratio, MAX_DET_SIDE / long)
    return _multiple_of_32(height * ratio), _multiple_of_32(width * ratio)


def _multiple_of_32(side: float) -> int:
    return round(int(side) / 32) * 32


def padding(height: int, width: int, config: OcrConfig) -> int:
    """Rows added above (and below) the image: rapidocr's `_get_padding_h` when it pads."""
    ratio = config.width_height_ratio
    too_wide = ratio != -1 and width / height > ratio
    if height > config.min_height and not too_wide:
        return 0
    new_height = max(int(width / ratio), config.min_height) * 2
    return int(abs(new_height - height) / 2)


def _clockwise(points: np.ndarray) -> np.ndarray:
    """tl, tr, br, bl: rapidocr's `TextDetector.order_points_clockwise`."""
    by_x = points[np.argsort(points[:, 0]), :]
    left, right = by_x[:2, :], by_x[2:, :]
    top_left, bottom_left = left[np.argsort(left[:, 1]), :]
    top_right, bottom_right = right[np.argsort(right[:, 1]), :]
    return np.array([top_left, top_right, bottom_right, bottom_left], dtype=np.float32)


def _clip(points: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Whole pixels inside the image: rapidocr's `clip_det_res`."""
    height, width = shape
    inside = np.clip(points, 0, (width - 1, height - 1))
    return np.asarray(np.floor(inside), dtype=np.float32)


def _big_enough(box: np.ndarray) -> bool:
    """Drops slivers of 3 pixels or less, as rapidocr's `filter_tag_det_res` does."""
    width = int(np.linalg.norm(box[0] - box[1]))
    height = int(np.linalg.norm(box[0] - box[3]))
    return width > 3 and height > 3


def to_original(boxes: np.ndarray, page: Page) -> np.ndarray:
    """Working-image corners → original pixels (rapidocr's `_get_origin_points`, then the
    JPEG draft's scale), clipped to the image."""
    points = boxes.astype(np.float64)
    points[..., 1] -= page.top
    points *= (page.scale_x, page.scale_y)
    return np.clip(points, 0, (page.width, page.height))
