"""Drafted JPEG decoding, seen through real models: the answers match a full decode's.

The classifier is the small convolutional one of the batch-invariance tests, the detector
nudenet's YOLOv8n; both run on ONNX Runtime. Inputs are photo-like JPEGs from the benchmark.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.inputs import jpeg
from kiln.app.model_spec import ImageModelSpec
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.base import Prepared
from kiln.workers.models.classify import ClassifyPipeline
from kiln.workers.models.detect import DetectorPipeline, model_path
from kiln.workers.preprocess import Decoded, center_crop, decode_image, letterbox
from tests.workers.models.test_batching_invariance import conv_classifier

MAX_PIXELS = 50_000_000


def full_decode(data: bytes) -> Decoded:
    """No draft, and not marked JPEG: Pillow's full path all the way."""
    decoded = decode_image(data, max_pixels=MAX_PIXELS)
    return Decoded(decoded.image, decoded.width, decoded.height)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> ClassifyPipeline:
    path = tmp_path_factory.mktemp("conv") / "conv.onnx"
    conv_classifier(path)
    spec = ImageModelSpec(input_size=64, labels=[f"c{i}" for i in range(10)]).as_dict()
    engine = OnnxRuntimeEngine(Path(path), max_batch=8)
    return ClassifyPipeline("conv", engine, spec, max_pixels=MAX_PIXELS)


def test_classifier_top_1_is_the_full_decodes(classifier: ClassifyPipeline) -> None:
    """1024×768 for a 64 crop (resize side 73): decoded at 1/8, 128×96."""
    inputs = [jpeg(seed, (1024, 768)) for seed in range(6)]
    drafted = [classifier.prepare(data) for data in inputs]
    sizer = classifier._resized  # what `prepare` drafts to
    assert decode_image(inputs[0], max_pixels=MAX_PIXELS, draft_to=sizer).image.size == (128, 96)
    full = [Prepared(center_crop(full_decode(data), 64)) for data in inputs]
    for a, b in zip(drafted, full, strict=True):
        assert a.pixels.shape == b.pixels.shape == (64, 64, 3)
        assert a.pixels.dtype == b.pixels.dtype == np.uint8
    ours = np.stack(classifier.infer(drafted))
    theirs = np.stack(classifier.infer(full))
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()
    assert np.abs(ours - theirs).max() < 0.02  # probabilities


def test_detector_scores_match_the_full_decode() -> None:
    """640×480 for the 320 detector: decoded at 1/2, exactly the fitted 320×240."""
    engine = OnnxRuntimeEngine(model_path(), max_batch=8)
    detector = DetectorPipeline(engine, max_pixels=MAX_PIXELS)
    inputs = [jpeg(seed, (640, 480)) for seed in range(3)]
    drafted = [detector.prepare(data) for data in inputs]
    full = []
    for data in inputs:
        pixels, fit = letterbox(full_decode(data), 320)
        full.append(Prepared(pixels, {"fit": fit}))
    for a, b in zip(drafted, full, strict=True):
        assert a.pixels.shape == b.pixels.shape == (320, 320, 3)
        assert a.meta["fit"] == b.meta["fit"]
        assert (a.pixels[240:] == 0).all() and (b.pixels[240:] == 0).all()
    for ours, theirs in zip(detector.infer(drafted), detector.infer(full), strict=True):
        scores, reference = ours[4:], theirs[4:]  # [classes, anchors]
        assert np.abs(scores - reference).max() < 0.02
        assert scores.max(axis=1).argmax() == reference.max(axis=1).argmax()  # the top class
