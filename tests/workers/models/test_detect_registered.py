"""A registered detector: the tiny YOLO of `yolo.py` on ONNX Runtime, fed as its spec declares,
decoded by the built-in detector's own `decode_yolo`."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.detect import YoloPredictor, decode_yolo
from kiln.workers.prep.pixels import Letterbox, Squash
from tests.support import migrated_settings
from tests.workers.models.halves import batch, outputs
from tests.workers.models.yolo import LABELS, SIZE, tiny_yolo

MAX_PIXELS = 10_000_000


def png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineFactory:
    settings = migrated_settings(tmp_path, monkeypatch)
    return EngineFactory(settings, LocalStore.from_url(settings.storage_url))


def detector(
    engines: EngineFactory, tmp_path: Path, layout: str = "NCHW", **spec: Any
) -> YoloPredictor:
    path = tiny_yolo(tmp_path / f"yolo-{layout}.onnx", layout=layout)
    stored = ImageModelSpec(input_size=SIZE, labels=LABELS, layout=layout, **spec).stored("detect")
    engine = engines.build("boxes:1", path, max_batch=8)
    return YoloPredictor("boxes:1", engine, stored, max_pixels=MAX_PIXELS)


def detect(pipe: YoloPredictor, images: list[bytes]) -> list[list[dict[str, Any]]]:
    return [found["detections"] for found in outputs(pipe, images)]


def test_letterboxed_boxes_map_back_to_the_image(engines: EngineFactory, tmp_path: Path) -> None:
    """64×48 into 32: scale 0.5, the bottom 8 rows padded black, so the mean red is 0.75."""
    (found,) = detect(detector(engines, tmp_path), [png((64, 48), (255, 0, 0))])
    assert found == [{"label": "red", "score": 0.75, "box": [8.0, 8.0, 24.0, 24.0]}]


def test_both_labels_and_the_second_anchor_dropped_by_nms(
    engines: EngineFactory, tmp_path: Path
) -> None:
    (found,) = detect(detector(engines, tmp_path), [png((64, 64), (255, 0, 255))])
    assert found == [
        {"label": "red", "score": 1.0, "box": [8.0, 8.0, 24.0, 24.0]},
        {"label": "blue", "score": 1.0, "box": [38.0, 38.0, 58.0, 58.0]},
    ]


def test_declared_nms_settings(engines: EngineFactory, tmp_path: Path) -> None:
    magenta = [png((64, 64), (255, 0, 255))]
    (one,) = detect(detector(engines, tmp_path, max_boxes=1), magenta)
    assert [d["label"] for d in one] == ["red"]
    (overlaps,) = detect(detector(engines, tmp_path, iou_threshold=0.9), magenta)
    assert [(d["label"], d["score"]) for d in overlaps] == [
        ("red", 1.0), ("blue", 1.0), ("red", 0.9)
    ]  # fmt: skip
    (none,) = detect(detector(engines, tmp_path, score_threshold=1.0), [png((64, 64), (200, 0, 0))])
    assert none == []


def test_a_squashed_image_maps_back_per_axis(engines: EngineFactory, tmp_path: Path) -> None:
    """64×48 squashed to 32: 0.5 across, 2/3 down, no padding (the mean red is 1)."""
    pipe = detector(engines, tmp_path, fit="squash")
    (found,) = detect(pipe, [png((64, 48), (255, 0, 0))])
    assert found == [{"label": "red", "score": 1.0, "box": [8.0, 6.0, 24.0, 18.0]}]


def test_bgr_feeds_red_as_the_models_third_channel(engines: EngineFactory, tmp_path: Path) -> None:
    (found,) = detect(
        detector(engines, tmp_path, channel_order="BGR"), [png((64, 64), (255, 0, 0))]
    )
    assert [(d["label"], d["score"]) for d in found] == [("blue", 1.0)]


def test_nhwc_layout_gives_the_same_boxes(engines: EngineFactory, tmp_path: Path) -> None:
    images = [png((64, 48), (255, 0, 128)), png((30, 90), (10, 200, 255))]
    nchw = detect(detector(engines, tmp_path), images)
    assert detect(detector(engines, tmp_path, layout="NHWC"), images) == nchw
    assert nchw[1] and nchw[1][0]["label"] == "blue"


def test_a_batch_of_the_wrong_width_fails(engines: EngineFactory, tmp_path: Path) -> None:
    """A detector registered with other labels than its graph scores: every batch fails."""
    path = tiny_yolo(tmp_path / "yolo.onnx")
    spec = ImageModelSpec(input_size=SIZE, labels=["a", "b", "c"]).stored("detect")
    pipe = YoloPredictor("boxes:1", engines.build("boxes:1", path, 8), spec, max_pixels=MAX_PIXELS)
    with pytest.raises(ValueError, match=r"returned shape \[1, 6, 3\], not \[N, 7, anchors\]"):
        pipe.infer(batch(pipe, [png((32, 32), (0, 0, 0))]))


def test_decode_yolo_takes_labels_a_squash_and_a_cap() -> None:
    raw = np.zeros((6, 2), dtype=np.float32)
    raw[:4, 0], raw[4, 0] = (10, 10, 4, 4), 0.8
    raw[:4, 1], raw[5, 1] = (20, 20, 4, 4), 0.9
    fit = Squash(scale_x=0.5, scale_y=2.0, width=80, height=20)
    found = decode_yolo(raw, fit, score_threshold=0.25, iou_threshold=0.45, labels=["a", "b"])
    assert found == [
        {"label": "b", "score": 0.9, "box": [36.0, 9.0, 44.0, 11.0]},
        {"label": "a", "score": 0.8, "box": [16.0, 4.0, 24.0, 6.0]},
    ]
    capped = decode_yolo(
        raw, Letterbox(1.0, 32, 32), score_threshold=0.25, iou_threshold=0.45, max_boxes=1
    )
    assert len(capped) == 1 and capped[0]["score"] == 0.9
