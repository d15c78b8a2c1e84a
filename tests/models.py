"""Tiny real ONNX models built in code: nothing is downloaded, nothing large is committed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def colour_classifier(path: Path) -> None:
    """A tiny real classifier: mean colour per channel → logits for red/green/blue/dark."""
    weights = np.array([[10, 0, 0], [0, 10, 0], [0, 0, 10], [-5, -5, -5]], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "W", "B"], ["logits"], transB=1),
        ],
        "colours",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [
            numpy_helper.from_array(weights, "W"),
            numpy_helper.from_array(np.zeros(4, np.float32), "B"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
