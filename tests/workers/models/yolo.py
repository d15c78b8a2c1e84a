"""A tiny real YOLOv8-shaped detector built in code, whose output the tests control.

Output [N, 4 + 2, 3]: three fixed anchors (boxes as centre and size in model pixels) and two
classes, `red` and `blue`, scored by the image's mean red and mean blue (as fed, 0–1):

- anchor 0: box (8, 8, 8, 8), red = mean red;
- anchor 1: box (9, 8, 8, 8), red = 0.9 × mean red (overlaps anchor 0: NMS drops it);
- anchor 2: box (24, 24, 10, 10), blue = mean blue.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SIZE = 32
LABELS = ["red", "blue"]
BOXES = np.array([[8, 9, 24], [8, 8, 24], [8, 8, 10], [8, 8, 10]], dtype=np.float32)


def _scores_weights() -> np.ndarray:
    """[3 channels, 2 classes × 3 anchors]: which channel scores which class at which anchor."""
    weights = np.zeros((3, 2, 3), dtype=np.float32)
    weights[0, 0, 0] = 1.0  # red at anchor 0
    weights[0, 0, 1] = 0.9  # red, weaker, at anchor 1
    weights[2, 1, 2] = 1.0  # blue at anchor 2
    return weights.reshape(3, 6)


def tiny_yolo(
    path: Path, *, layout: str = "NCHW", anchors_first: bool = False, size: int = SIZE
) -> Path:
    """The detector above; `anchors_first` transposes its output to [N, 3, 6] (refused)."""
    nodes, image = [], "images"
    if layout == "NHWC":
        nodes.append(helper.make_node("Transpose", [image], ["nchw"], perm=[0, 3, 1, 2]))
        image = "nchw"
    nodes += [
        helper.make_node("GlobalAveragePool", [image], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["colour"]),
        helper.make_node("MatMul", ["colour", "W"], ["flat_scores"]),
        helper.make_node("Reshape", ["flat_scores", "score_shape"], ["scores"]),
        helper.make_node("Shape", [image], ["image_shape"]),
        helper.make_node("Slice", ["image_shape", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "box_dims"], ["box_shape"], axis=0),
        helper.make_node("Expand", ["boxes", "box_shape"], ["batch_boxes"]),
        helper.make_node("Concat", ["batch_boxes", "scores"], ["head"], axis=1),
    ]
    out_shape: list[int | str] = ["N", 6, 3]
    if anchors_first:
        nodes.append(helper.make_node("Transpose", ["head"], ["output"], perm=[0, 2, 1]))
        out_shape = ["N", 3, 6]
    else:
        nodes.append(helper.make_node("Identity", ["head"], ["output"]))
    shape: list[int | str] = ["N", 3, size, size] if layout == "NCHW" else ["N", size, size, 3]
    graph = helper.make_graph(
        nodes,
        "tiny_yolo",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, out_shape)],
        [
            numpy_helper.from_array(_scores_weights(), "W"),
            numpy_helper.from_array(np.array([-1, 2, 3], np.int64), "score_shape"),
            numpy_helper.from_array(BOXES[None], "boxes"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([4, 3], np.int64), "box_dims"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def identity_model(path: Path, *, layout: str = "NCHW", size: int = 16) -> Path:
    """Returns its input: what a predictor feeds, seen through a real engine."""
    shape: list[int | str] = ["N", 3, size, size] if layout == "NCHW" else ["N", size, size, 3]
    graph = helper.make_graph(
        [helper.make_node("Identity", ["images"], ["fed"])],
        "identity",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("fed", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path
