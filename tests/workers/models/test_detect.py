"""The detector's NumPy post-processing: NMS and YOLOv8 output decoding."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.workers.models.detect import LABELS, decode_yolo, nms
from kiln.workers.prep.pixels import Letterbox


def test_nms_overlapping_keeps_only_the_best() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11]], dtype=np.float32)  # IoU 81/119 ≈ 0.68
    scores = np.array([0.8, 0.9], dtype=np.float32)
    assert nms(boxes, scores, 0.5) == [1]


def test_nms_keeps_overlaps_under_the_threshold() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11]], dtype=np.float32)
    scores = np.array([0.8, 0.9], dtype=np.float32)
    assert nms(boxes, scores, 0.7) == [1, 0]


def test_nms_disjoint_boxes_are_all_kept_best_first() -> None:
    boxes = np.array(
        [[0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50], [60, 0, 70, 10]], dtype=np.float32
    )
    scores = np.array([0.3, 0.9, 0.5, 0.7], dtype=np.float32)
    assert nms(boxes, scores, 0.5) == [1, 3, 2, 0]


def test_nms_touching_boxes_do_not_overlap() -> None:
    boxes = np.array([[0, 0, 10, 10], [10, 0, 20, 10]], dtype=np.float32)
    assert nms(boxes, np.array([0.5, 0.6], dtype=np.float32), 0.0) == [1, 0]


def test_nms_chain() -> None:
    # b0 suppresses b1; b2 overlaps b1 but not b0, so it survives.
    boxes = np.array([[0, 0, 10, 10], [2, 0, 12, 10], [9, 0, 19, 10]], dtype=np.float32)
    scores = np.array([0.9, 0.8, 0.7], dtype=np.float32)
    assert nms(boxes, scores, 0.5) == [0, 2]


def test_nms_equal_scores_keep_input_order() -> None:
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10]], dtype=np.float32)
    assert nms(boxes, np.array([0.5, 0.5], dtype=np.float32), 0.5) == [0]


def test_nms_empty() -> None:
    assert nms(np.zeros((0, 4), dtype=np.float32), np.zeros(0, dtype=np.float32), 0.5) == []


def raw_output(anchors: list[tuple[float, float, float, float, int, float]], classes: int = 18):
    """[4 + classes, N]: one column per anchor (cx, cy, w, h, class id, score)."""
    raw = np.zeros((4 + classes, len(anchors)), dtype=np.float32)
    for j, (cx, cy, w, h, class_id, score) in enumerate(anchors):
        raw[:4, j] = (cx, cy, w, h)
        raw[4 + class_id, j] = score
        raw[4 + (class_id + 1) % classes, j] = score / 10  # a weaker runner-up class
    return raw


def test_decode_yolo_maps_boxes_back_and_clips() -> None:
    # A 200×100 image letterboxed into 320 px: scale 1.6, content in the top 160 rows.
    fit = Letterbox(scale=1.6, width=200, height=100)
    raw = raw_output(
        [
            (80, 40, 32, 16, 3, 0.9),  # → (40, 20, 60, 30) in original pixels
            (81, 41, 32, 16, 3, 0.6),  # same object, lower score: suppressed
            (300, 150, 64, 32, 1, 0.5),  # → (167.5, 83.75, 207.5, 103.75): clipped to 200×100
            (8, 8, 32, 32, 12, 0.4),  # → (-5, -5, 15, 15): clipped at 0
            (200, 50, 20, 20, 0, 0.2),  # under the threshold
        ]
    )
    detections = decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45)
    assert detections == [
        {"label": LABELS[3], "score": 0.9, "box": [40.0, 20.0, 60.0, 30.0]},
        {"label": LABELS[1], "score": 0.5, "box": [167.5, 83.8, 200.0, 100.0]},
        {"label": LABELS[12], "score": 0.4, "box": [0.0, 0.0, 15.0, 15.0]},
    ]


def test_decode_yolo_all_under_threshold() -> None:
    fit = Letterbox(scale=1.0, width=320, height=320)
    raw = raw_output([(100, 100, 10, 10, 0, 0.1), (50, 50, 10, 10, 2, 0.24)])
    assert decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45) == []


def test_decode_yolo_score_at_threshold_is_kept() -> None:
    fit = Letterbox(scale=1.0, width=320, height=320)
    raw = raw_output([(100, 100, 10, 10, 0, 0.5)])
    assert len(decode_yolo(raw, fit, score_threshold=0.5, iou_threshold=0.45)) == 1


def test_decode_yolo_uses_the_best_class() -> None:
    fit = Letterbox(scale=1.0, width=320, height=320)
    raw = np.zeros((4 + 18, 1), dtype=np.float32)
    raw[:4, 0] = (100, 100, 20, 20)
    raw[4 + 5, 0] = 0.3
    raw[4 + 7, 0] = 0.8
    (detection,) = decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45)
    assert detection["label"] == LABELS[7]
    assert detection["score"] == pytest.approx(0.8)


def test_decode_yolo_unknown_class_falls_back_to_its_index() -> None:
    fit = Letterbox(scale=1.0, width=320, height=320)
    raw = raw_output([(100, 100, 20, 20, 19, 0.9)], classes=20)
    (detection,) = decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45)
    assert detection["label"] == "19"


def test_decode_yolo_output_is_json_friendly() -> None:
    fit = Letterbox(scale=1.0, width=320, height=320)
    raw = raw_output([(100, 100, 20, 20, 2, 0.87654321)])
    (detection,) = decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45)
    assert type(detection["score"]) is float
    assert detection["score"] == 0.8765
    assert all(type(v) is float for v in detection["box"])
