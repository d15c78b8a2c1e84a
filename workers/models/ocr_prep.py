"""The prep half of the built-in OCR model: decode, the working image (PP-OCR's page) and the
text detector's input, which keep each image's aspect: they travel as objects, not slots."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.workers.models.ocr_config import load_config
from kiln.workers.models.ocr_det import Detection
from kiln.workers.prep.images import images_only
from kiln.workers.prep.pixels import Decoded, decode_image


class OcrPrep:
    def __init__(self, max_pixels: int) -> None:
        self.config = load_config()
        self.detection = Detection(self.config)
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        # JPEGs decode straight to a smaller DCT scale when far larger than the working image.
        decoded = decode_image(
            images_only(data), max_pixels=self.max_pixels, draft_to=self.config.max_side_len
        )
        return self.prepare_decoded(decoded, slot, meta)

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        side = self.config.max_side_len
        return side, side

    def prepare_decoded(self, decoded: Decoded, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        page = self.detection.page(decoded)
        return self.detection.input(page), page
