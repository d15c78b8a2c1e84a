"""YOLOv8-style detectors: the built-in `detector` and any registered `detect` model.

The built-in is NudeNet's YOLOv8n (320 px) body-part/nudity detector, not a general object
detector: its labels are NudeNet's (FACE_FEMALE, BUTTOCKS_EXPOSED, …). A registered detector
brings its own labels, preprocessing and NMS settings; both decode boxes and run NMS here, in
NumPy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.model_spec import Detection
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared
from kiln.workers.models.image_model import ImageModelPipeline
from kiln.workers.preprocess import Placement

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
    raw: np.ndarray,
    fit: Placement,
    *,
    score_threshold: float,
    iou_threshold: float,
    labels: Sequence[str] = LABELS,
    max_boxes: int | None = None,
) -> list[dict[str, Any]]:
    """One image's YOLOv8 output [4 + classes, anchors] → boxes in original pixels, best
    first, at most `max_boxes` of them."""
    predictions = raw.T
    class_scores = predictions[:, 4:]
    class_ids = class_scores.argmax(axis=1)
    scores = class_scores[np.arange(len(class_ids)), class_ids]
    mask = scores >= score_threshold
    cx, cy, w, h = (predictions[mask, i] for i in range(4))
    scale_x, scale_y = fit.scales
    scales = np.asarray([scale_x, scale_y, scale_x, scale_y], dtype=predictions.dtype)
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1) / scales
    boxes = np.clip(boxes, 0, [fit.width, fit.height, fit.width, fit.height])
    scores, class_ids = scores[mask], class_ids[mask]
    kept = nms(boxes, scores, iou_threshold)
    return [
        {
            "label": labels[int(class_ids[i])] if class_ids[i] < len(labels) else str(class_ids[i]),
            "score": round(float(scores[i]), 4),
            "box": [round(float(v), 1) for v in boxes[i]],
        }
        for i in (kept if max_boxes is None else kept[:max_boxes])
    ]


class YoloPipeline(ImageModelPipeline):
    """A registered detector: output [N, 4 + classes, anchors], boxes as centre and size in
    model pixels, one score per label; letterboxed unless its spec says squash."""

    kind = "detect"

    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        super().__init__(name, engine, spec, max_pixels=max_pixels)
        self.labels = tuple(self.declared.labels)
        self.detection = self.declared.detection()

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        output = self._output(rows)
        if output.ndim != 3 or output.shape[1] != 4 + len(self.labels):
            raise ValueError(
                f"Model {self.name!r} returned shape {list(output.shape)}, not "
                f"[N, {4 + len(self.labels)}, anchors] (4 box values and {len(self.labels)} "
                f"class scores per anchor)."
            )
        return list(output)

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        self._raise_if_failed(row)
        found = self.detection
        detections = decode_yolo(
            raw,
            row.meta["fit"],
            score_threshold=found.score_threshold,
            iou_threshold=found.iou_threshold,
            labels=self.labels,
            max_boxes=found.max_boxes,
        )
        return {"detections": detections}


class DetectorPipeline(YoloPipeline):
    """The built-in detector: NudeNet's labels, letterboxed to `size`, pixels scaled to 0–1."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_pixels: int,
        size: int = 320,
        score_threshold: float = 0.25,
        iou_threshold: float = 0.45,
    ) -> None:
        spec = {"input_size": size, "labels": list(LABELS), "fit": "letterbox"}
        super().__init__("detector", engine, spec, max_pixels=max_pixels)
        # NudeNet's answer keeps every box NMS keeps.
        self.detection = Detection(score_threshold, iou_threshold, max_boxes=None)
