"""The built-in `detector`: NudeNet's YOLOv8n (320 px) body-part/nudity detector, with NMS in NumPy.

Not a general object detector: its labels are NudeNet's (FACE_FEMALE, BUTTOCKS_EXPOSED, …)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared
from kiln.workers.preprocess import Letterbox, decode_image, letterbox, normalize, stack

LABELS = (
    "FEMALE_GENITALIA_COVERED", "FACE_FEMALE", "BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED", "MALE_BREAST_EXPOSED", "ANUS_EXPOSED", "FEET_EXPOSED",
    "BELLY_COVERED", "FEET_COVERED", "ARMPITS_COVERED", "ARMPITS_EXPOSED", "FACE_MALE",
    "BELLY_EXPOSED", "MALE_GENITALIA_EXPOSED", "ANUS_COVERED", "FEMALE_BREAST_COVERED",
    "BUTTOCKS_COVERED",
)  # fmt: skip

_DETECTION = pa.struct(
    [("label", pa.string()), ("score", pa.float32()), ("box", pa.list_(pa.float32(), 4))]
)
FIELDS = [pa.field("detections", pa.list_(_DETECTION))]


def model_path() -> Path:
    import nudenet

    return Path(nudenet.__file__).parent / "320n.onnx"


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> list[int]:
    """Greedy non-maximum suppression over xyxy boxes; indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    while order.size:
        best, rest = int(order[0]), order[1:]
        keep.append(best)
        x1 = np.maximum(boxes[best, 0], boxes[rest, 0])
        y1 = np.maximum(boxes[best, 1], boxes[rest, 1])
        x2 = np.minimum(boxes[best, 2], boxes[rest, 2])
        y2 = np.minimum(boxes[best, 3], boxes[rest, 3])
        inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
        iou = inter / np.maximum(areas[best] + areas[rest] - inter, 1e-9)
        order = rest[iou <= iou_threshold]
    return keep


def decode_yolo(
    raw: np.ndarray, fit: Letterbox, *, score_threshold: float, iou_threshold: float
) -> list[dict[str, Any]]:
    """One image's YOLOv8 output [4 + classes, anchors] → boxes in original pixels."""
    predictions = raw.T
    class_scores = predictions[:, 4:]
    class_ids = class_scores.argmax(axis=1)
    scores = class_scores[np.arange(len(class_ids)), class_ids]
    mask = scores >= score_threshold
    cx, cy, w, h = (predictions[mask, i] for i in range(4))
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1) / fit.scale
    boxes = np.clip(boxes, 0, [fit.width, fit.height, fit.width, fit.height])
    scores, class_ids = scores[mask], class_ids[mask]
    detections = []
    for i in nms(boxes, scores, iou_threshold):
        detections.append(
            {
                "label": LABELS[int(class_ids[i])]
                if class_ids[i] < len(LABELS)
                else str(class_ids[i]),
                "score": round(float(scores[i]), 4),
                "box": [round(float(v), 1) for v in boxes[i]],
            }
        )
    return detections


class DetectorPipeline:
    name = "detector"
    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads

    def __init__(
        self,
        engine: Engine,
        *,
        max_pixels: int,
        size: int = 320,
        score_threshold: float = 0.25,
        iou_threshold: float = 0.45,
    ) -> None:
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.size = size
        self.max_pixels = max_pixels
        self.score_threshold = score_threshold
        self.iou_threshold = iou_threshold
        self.input_name = engine.inputs[0].name

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        image = decode_image(data, max_pixels=self.max_pixels, draft_to=self.size)
        pixels, fit = letterbox(image, self.size)
        return Prepared(pixels, {"fit": fit})

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        pixels = stack([r.pixels for r in rows])
        (output,) = self.engine.infer(
            {self.input_name: pixels}, {self.input_name: normalize}
        ).values()
        return list(output)

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        detections = decode_yolo(
            raw,
            row.meta["fit"],
            score_threshold=self.score_threshold,
            iou_threshold=self.iou_threshold,
        )
        return {"detections": detections}

    def close(self) -> None:
        """Nothing beyond the engine to release."""
