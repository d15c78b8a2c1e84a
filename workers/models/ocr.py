"""The built-in OCR model: PP-OCRv4 det/cls/rec ONNX files shipped by rapidocr-onnxruntime.

First version: the rapidocr pipeline runs per image inside the Batcher's runner thread, so
the runner still owns the CPU/GPU, but recognition crops are not yet batched across images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from PIL import Image

from app.core.errors import InputError
from workers.models.base import Prepared
from workers.preprocess import decode_image

MAX_SIDE = 2000  # rapidocr shrinks larger images anyway; doing it here saves the copy

_LINE = pa.struct(
    [
        ("text", pa.string()),
        ("score", pa.float32()),
        ("box", pa.list_(pa.list_(pa.float32(), 2), 4)),
    ]
)
FIELDS = [pa.field("text", pa.string()), pa.field("lines", pa.list_(_LINE))]


class OcrPipeline:
    name = "ocr"
    max_batch = 8
    max_runners = 1  # one RapidOCR pipeline object, not shared across threads

    def __init__(self, *, max_pixels: int) -> None:
        from rapidocr_onnxruntime import RapidOCR

        self.ocr = RapidOCR()
        self.backend = "onnxruntime:CPUExecutionProvider (rapidocr)"
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=MAX_SIDE)
        image = decoded.image
        scale = min(1.0, MAX_SIDE / max(image.size))
        if scale < 1.0:
            size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
            image = image.resize(size, Image.Resampling.BILINEAR)
        to_original = decoded.width / image.width
        bgr = np.ascontiguousarray(np.asarray(image)[:, :, ::-1])
        return Prepared(bgr, {"to_original": to_original})

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        return [self.ocr(row.pixels)[0] or [] for row in rows]

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        factor = row.meta["to_original"]
        lines = [
            {
                "text": str(text),
                "score": round(float(score), 4),
                "box": [[round(float(x) * factor, 1), round(float(y) * factor, 1)] for x, y in box],
            }
            for box, text, score in raw
        ]
        return {"text": "\n".join(str(line["text"]) for line in lines), "lines": lines}

    def close(self) -> None:
        """Nothing beyond the engine to release."""
