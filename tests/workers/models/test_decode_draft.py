"""Drafted JPEG decoding, seen through real models: the answers match a full decode's.

The classifier is the small convolutional one of the batch-invariance tests, the detector
nudenet's YOLOv8n; both run on ONNX Runtime. Inputs are photo-like JPEGs from the benchmark.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.inputs import jpeg
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.base import Batch
from kiln.workers.models.classify import ClassifyPredictor, softmax
from kiln.workers.models.detect import DetectorPredictor, model_path
from kiln.workers.prep.images import FIT_WIDTH, placement_row
from kiln.workers.prep.pixels import Decoded, center_crop, decode_image, letterbox
from tests.workers.models.halves import Row, batch_of, prep_of, prepare
from tests.workers.models.test_batching_invariance import conv_classifier

MAX_PIXELS = 50_000_000


def full_decode(data: bytes) -> Decoded:
    """No draft, and not marked JPEG: Pillow's full path all the way."""
    decoded = decode_image(data, max_pixels=MAX_PIXELS)
    return Decoded(decoded.image, decoded.width, decoded.height)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> ClassifyPredictor:
    path = tmp_path_factory.mktemp("conv") / "conv.onnx"
    conv_classifier(path)
    spec = ImageModelSpec(input_size=64, labels=[f"c{i}" for i in range(10)]).as_dict()
    engine = OnnxRuntimeEngine(Path(path), max_batch=8)
    return ClassifyPredictor("conv", engine, spec, max_pixels=MAX_PIXELS)


def probabilities(classifier: ClassifyPredictor, pixels: list[np.ndarray]) -> np.ndarray:
    """The classifier's probabilities for fitted pixels, as its `infer` computes them."""
    logits, failed = classifier._run(
        Batch(np.stack(pixels), np.zeros((len(pixels), FIT_WIDTH), np.float32))
    )
    assert not failed
    return softmax(logits)


def test_classifier_top_1_is_the_full_decodes(classifier: ClassifyPredictor) -> None:
    """1024×768 for a 64 crop (resize side 73): decoded at 1/8, 128×96."""
    inputs = [jpeg(seed, (1024, 768)) for seed in range(6)]
    drafted = [prepare(classifier, data).slot for data in inputs]
    sizer = prep_of(classifier.prep)._sizer  # type: ignore[attr-defined]  # what prep drafts to
    assert decode_image(inputs[0], max_pixels=MAX_PIXELS, draft_to=sizer).image.size == (128, 96)
    full = [center_crop(full_decode(data), 64) for data in inputs]
    for a, b in zip(drafted, full, strict=True):
        assert a is not None
        assert a.shape == b.shape == (64, 64, 3)
        assert a.dtype == b.dtype == np.uint8
    ours = probabilities(classifier, drafted)  # type: ignore[arg-type]
    theirs = probabilities(classifier, full)
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).all()
    assert np.abs(ours - theirs).max() < 0.02  # probabilities


def test_detector_scores_match_the_full_decode() -> None:
    """640×480 for the 320 detector: decoded at 1/2, exactly the fitted 320×240."""
    engine = OnnxRuntimeEngine(model_path(), max_batch=8)
    detector = DetectorPredictor(engine, max_pixels=MAX_PIXELS)
    inputs = [jpeg(seed, (640, 480)) for seed in range(3)]
    drafted = [prepare(detector, data) for data in inputs]
    full = []
    for data in inputs:
        pixels, fit = letterbox(full_decode(data), 320)
        full.append(Row(pixels, np.asarray(placement_row(fit), dtype=np.float32), None))
    for a, b in zip(drafted, full, strict=True):
        assert a.slot is not None and b.slot is not None
        assert a.slot.shape == b.slot.shape == (320, 320, 3)
        np.testing.assert_array_equal(a.meta, b.meta)  # the same fit: boxes map back alike
        assert (a.slot[240:] == 0).all() and (b.slot[240:] == 0).all()
    ours_raw, _ = detector._output(batch_of(drafted))
    theirs_raw, _ = detector._output(batch_of(full))
    for ours, theirs in zip(ours_raw, theirs_raw, strict=True):
        scores, reference = ours[4:], theirs[4:]  # [classes, anchors]
        assert np.abs(scores - reference).max() < 0.02
        assert scores.max(axis=1).argmax() == reference.max(axis=1).argmax()  # the top class
