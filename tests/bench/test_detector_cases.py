"""The built-in detector as a bench model, and how the Ray case keeps start-up out of its window:
pure functions and a fake predictor, no services, no timings asserted."""

from __future__ import annotations

import io
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from rich.console import Console

from bench.cases.loop import finish, prepare
from bench.cases.ray_data import WindowWhenReady
from bench.measure import Meter
from bench.models import DETECTOR, detector_model, preprocessing
from bench.plan import PRESETS
from bench.run import Runner
from bench.run import prepare as prepare_context
from kiln.workers.models.detect import LABELS, model_path


def _jpeg(width: int = 640, height: int = 480) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def test_the_detector_is_kilns_own_file_side_and_labels() -> None:
    path, side, labels = detector_model()
    assert path == model_path() and path.exists()
    assert side == 320 and labels == list(LABELS)
    assert preprocessing(DETECTOR) == "letterbox"
    assert preprocessing("resnet18") == "crop"


def test_letterbox_prepares_as_kiln_does_and_finishes_with_boxes() -> None:
    x, fit = prepare("letterbox", _jpeg(), 320)
    assert x.shape == (1, 3, 320, 320) and x.dtype == np.float32
    assert float(x.max()) <= 1.0
    assert float(x[0, :, 240:, :].max()) == 0.0  # 640×480 fits as 320×240: black padding below
    assert (fit.width, fit.height, fit.scale) == (640, 480, 0.5)
    output = np.zeros((4 + len(LABELS), 2100), dtype=np.float32)
    output[:4, 0] = [160, 120, 40, 20]  # cx, cy, w, h in model pixels
    output[5, 0] = 0.9  # FACE_FEMALE
    [box] = finish("letterbox", output, fit)
    assert box["label"] == "FACE_FEMALE" and box["box"] == [280.0, 220.0, 360.0, 260.0]


def test_crop_keeps_the_plain_path() -> None:
    x, meta = prepare("crop", _jpeg(), 224)
    assert x.shape == (1, 3, 224, 224) and meta is None
    assert list(finish("crop", np.arange(10.0), None)) == [9, 8, 7, 6, 5]


def test_context_takes_the_built_in_and_skips_cases_that_register_models(tmp_path: Path) -> None:
    plan = PRESETS["smoke"].with_(models=(DETECTOR,), cases=("raw", "embedded", "naive-celery"))
    ctx = prepare_context(plan, tmp_path, Console(quiet=True))
    assert ctx.models[DETECTOR].onnx == model_path()
    assert ctx.models[DETECTOR].input_size == 320
    assert not (tmp_path / "models" / f"{DETECTOR}.onnx").exists()  # nothing exported
    runner = Runner(ctx, Console(quiet=True))
    for case in ("embedded", "naive-celery"):
        runner._paired_case(case, DETECTOR)
    assert [(r.case, r.skipped is not None) for r in runner.results] == [
        ("embedded", True),
        ("naive-celery", True),
    ]
    assert runner.failures == []


def test_ray_window_opens_only_once_every_actor_is_up(tmp_path: Path) -> None:
    window = WindowWhenReady(Meter({"subject": []}), str(tmp_path), 2)
    (tmp_path / "1").touch()
    assert window.opened_at is None  # one actor of two: still start-up
    (tmp_path / "2").touch()
    deadline = time.monotonic() + 30
    while window.opened_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert window.opened_at is not None
    usage = window.close()
    assert usage.seconds >= 0


def test_ray_window_refuses_a_run_that_ended_before_its_actors(tmp_path: Path) -> None:
    window = WindowWhenReady(Meter({"subject": []}), str(tmp_path), 1)
    with pytest.raises(RuntimeError, match="before its actors"):
        window.close()
