"""An item's outputs do not depend on the batch it lands in, nor on its neighbours (1e-4).

Real engines (ONNX Runtime, as the worker builds them): the detector shipped by nudenet, and a
small convolutional classifier built here. OCR, text-embed and embed have their own such tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from devstack.images import photo
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.classify import ClassifyPredictor
from kiln.workers.models.detect import DetectorPredictor, model_path
from kiln.workers.models.image_model import ImageModelPredictor
from tests.support import migrated_settings
from tests.workers.models.halves import batch

TOLERANCE = 1e-4


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, max_batch=8)


@pytest.fixture
def engines(settings: Settings) -> EngineFactory:
    return EngineFactory(settings, LocalStore.from_url(settings.storage_url))


def conv_classifier(path: Path, classes: int = 10) -> None:
    """Conv → ReLU → Conv → global pool → dense: enough arithmetic for batch effects to show."""
    rng = np.random.default_rng(0)
    weights = {
        "W1": rng.normal(0, 0.2, (16, 3, 3, 3)).astype(np.float32),
        "W2": rng.normal(0, 0.2, (32, 16, 3, 3)).astype(np.float32),
        "W3": rng.normal(0, 0.2, (classes, 32)).astype(np.float32),
        "B3": np.zeros(classes, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["images", "W1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["c2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("Gemm", ["flat", "W3", "B3"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def raw_outputs(
    predictor: ImageModelPredictor, inputs: list[bytes], order: list[int]
) -> dict[int, Any]:
    """The engine's output row of each input, for one batch of the inputs in `order`."""
    output, failed = predictor._output(batch(predictor, [inputs[i] for i in order]))
    assert not failed
    return dict(zip(order, output, strict=True))


def assert_invariant(predictor: ImageModelPredictor, inputs: list[bytes]) -> None:
    n = len(inputs)
    alone = {i: raw_outputs(predictor, inputs, [i])[i] for i in range(n)}
    for order in (list(range(n)), list(reversed(range(n))), [1, 0, 3, 2, 5, 4][:n]):
        together = raw_outputs(predictor, inputs, order)
        for i in range(n):
            np.testing.assert_allclose(together[i], alone[i], atol=TOLERANCE, rtol=0)


def test_the_detector_is_batch_invariant(engines: EngineFactory, settings: Settings) -> None:
    engine = engines.build("detector", model_path(), settings.max_batch)
    predictor = DetectorPredictor(engine, max_pixels=settings.max_image_pixels)
    assert_invariant(predictor, [photo(40 + i) for i in range(6)])


def test_a_classifier_is_batch_invariant(
    engines: EngineFactory, settings: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "conv.onnx"
    conv_classifier(path)
    spec = ImageModelSpec(input_size=64, labels=[f"c{i}" for i in range(10)]).as_dict()
    engine = engines.build("conv", path, settings.max_batch)
    predictor = ClassifyPredictor("conv", engine, spec, max_pixels=settings.max_image_pixels)
    assert_invariant(predictor, [photo(60 + i) for i in range(6)])
