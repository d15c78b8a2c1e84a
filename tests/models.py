"""Tiny real ONNX models built in code: nothing is downloaded, nothing large is committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def oom_embedder(path: Path) -> None:
    """A 3-d embedder whose engine runs out of memory on batches over 2: for those, a branch
    asks ONNX Runtime for a 4 TiB buffer, a real allocation failure (nothing is allocated)."""
    huge = helper.make_graph(
        [
            helper.make_node(
                "ConstantOfShape", ["huge_shape"], ["huge"],
                value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
            ),
            helper.make_node("ReduceSum", ["huge"], ["t_out"], keepdims=0),
        ],
        "then", [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.array([1 << 40], np.int64), "huge_shape")],
    )  # fmt: skip
    fits = helper.make_graph(
        [helper.make_node("Constant", [], ["e_out"],
                          value=helper.make_tensor("z", TensorProto.FLOAT, [], [0.0]))],
        "else", [], [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [])],
    )  # fmt: skip
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["images"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
            helper.make_node("Greater", ["n", "two"], ["big"]),
            helper.make_node("If", ["big"], ["extra"], then_branch=huge, else_branch=fits),
            helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Add", ["flat", "extra"], ["embedding"]),
        ],
        "oom",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, 32, 32])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 3])],
        [
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(np.array(2, np.int64), "two"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)


def thumbnail_embedder(path: Path, side: int = 32, grid: int = 8) -> None:
    """A tiny real image embedder: the picture averaged down to a `grid`×`grid` colour
    thumbnail, flattened (3·grid² floats). Resized, re-encoded or slightly cropped copies of a
    picture stay close; distinct pictures, centred by the spec's mean, point elsewhere."""
    pool = side // grid
    graph = helper.make_graph(
        [
            helper.make_node(
                "AveragePool", ["images"], ["pooled"], kernel_shape=[pool, pool],
                strides=[pool, pool],
            ),
            helper.make_node("Flatten", ["pooled"], ["embedding"]),
        ],
        "thumbnails",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, side, side])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["N", 3 * grid * grid])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    onnx.save(model, path)


# How Kiln feeds `thumbnail_embedder` (registered with this spec).
THUMBS = {"input_size": 32, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5]}


def register_thumbnail_embedder(client: Any, tmp_path: Path, name: str) -> str:
    """Register `thumbnail_embedder` as `name` through `POST /v1/models` (an httpx client or
    FastAPI's TestClient); returns its ref."""
    path = tmp_path / f"{name}.onnx"
    thumbnail_embedder(path)
    form = {"name": name, "kind": "embed", "spec": json.dumps(THUMBS)}
    upload = [("file", ("m.onnx", path.read_bytes(), "application/octet-stream"))]
    response = client.post("/v1/models", data=form, files=upload)
    assert response.status_code == 201, response.text
    return str(response.json()["ref"])
