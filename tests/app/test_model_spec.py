"""Registration checks a spec against its ONNX graph: every contradiction is one sentence."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import convert_model_to_external_data

from kiln.app.core.errors import InputError
from kiln.app.model_spec import ImageModelSpec, check_onnx
from tests.models import colour_classifier

Dims = Sequence[int | str | None]
LABELS = ["red", "green", "blue", "dark"]


def image_model(
    images: Dims = ("N", 3, 32, 32),
    out: Dims | None = ("N", 4),
    *,
    layout: str = "NCHW",
    in_type: int = TensorProto.FLOAT,
    out_type: int = TensorProto.FLOAT,
    rank4: bool = False,
) -> bytes:
    """A real little net: mean colour → 4 scores, declared with the given shapes and types."""
    nodes = [helper.make_node("Cast", ["images"], ["pixels"], to=TensorProto.FLOAT)]
    axes = [2, 3] if layout == "NCHW" else [1, 2]
    nodes += [
        helper.make_node("ReduceMean", ["pixels"], ["colour"], axes=axes, keepdims=0),
        helper.make_node("MatMul", ["colour", "W"], ["scores"]),
    ]
    if rank4:  # [N, 4, 1, 1], as a convolutional head without a Flatten gives
        nodes.append(helper.make_node("Reshape", ["scores", "to4"], ["scores4"]))
    last = "scores4" if rank4 else "scores"
    nodes.append(helper.make_node("Cast", [last], ["out"], to=out_type))
    graph = helper.make_graph(
        nodes,
        "colours",
        [helper.make_tensor_value_info("images", in_type, list(images))],
        [helper.make_tensor_value_info("out", out_type, list(out or ("N", 4)))],
        [
            numpy_helper.from_array(np.eye(3, 4, dtype=np.float32), "W"),
            numpy_helper.from_array(np.array([-1, 4, 1, 1], np.int64), "to4"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    if out is None:  # as some exporters leave it (the checker wants it, ONNX Runtime does not)
        model.graph.output[0].type.tensor_type.ClearField("shape")
    return bytes(model.SerializeToString())


def pixel_embedder() -> bytes:
    """Grey pixels flattened: a vector as wide as the image, unknown until it runs."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["images"], ["grey"], axes=[1], keepdims=1),
            helper.make_node("Flatten", ["grey"], ["out"], axis=1),
        ],
        "pixels",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", "D"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    onnx.checker.check_model(model)
    return bytes(model.SerializeToString())


def spec(**change: Any) -> ImageModelSpec:
    return ImageModelSpec(**{"input_size": 32, "labels": LABELS, **change})


def refused(data: bytes, kind: str = "classify", **change: Any) -> str:
    with pytest.raises(InputError) as caught:
        check_onnx(data, kind, spec(**change))
    return str(caught.value)


def test_a_fitting_classifier_is_stored_with_its_spec(tmp_path: Path) -> None:
    colour_classifier(tmp_path / "c.onnx")
    stored = check_onnx((tmp_path / "c.onnx").read_bytes(), "classify", spec(top_k=2))
    assert stored["input_size"] == 32 and stored["labels"] == LABELS and stored["top_k"] == 2
    assert stored["max_batch"] is None  # a dynamic batch axis leaves the spec's choice


def test_input_size_must_match_the_fixed_input() -> None:
    data = image_model(("N", 3, 224, 224))
    assert refused(data, input_size=256) == (
        "The model's input is 224 pixels a side, but input_size is 256; "
        "register it with input_size 224."
    )
    assert check_onnx(data, "classify", spec(input_size=224))["input_size"] == 224


def test_one_fixed_side_is_enough_to_contradict() -> None:
    assert "224 pixels a side, but input_size is 256" in refused(
        image_model(("N", 3, "H", 224)), input_size=256
    )


def test_a_dynamic_height_and_width_take_any_input_size() -> None:
    data = image_model(("N", 3, "H", "W"))
    assert check_onnx(data, "classify", spec(input_size=300))["input_size"] == 300


def test_a_fixed_input_that_is_not_square() -> None:
    message = refused(image_model(("N", 3, 224, 160)), input_size=224)
    assert message.startswith("The model's input is 224×160 pixels (height×width)")


def test_nhwc_is_checked_on_its_own_axes() -> None:
    data = image_model(("N", 32, 32, 3), layout="NHWC")
    assert check_onnx(data, "embed", spec(layout="NHWC"))["dim"] == 4
    assert "input is 32 pixels a side, but input_size is 64" in refused(
        data, "embed", layout="NHWC", input_size=64
    )


def test_a_layout_the_other_way_round() -> None:
    nhwc = image_model(("N", 32, 32, 3), layout="NHWC")
    assert refused(nhwc) == (
        "The model's input is [?, 32, 32, 3], laid out NHWC, but the spec's layout is NCHW."
    )
    nchw = image_model(("N", 3, 32, 32))
    assert "laid out NCHW, but the spec's layout is NHWC" in refused(nchw, "embed", layout="NHWC")


def test_a_classifier_is_fed_nchw_only() -> None:
    nhwc = image_model(("N", 32, 32, 3), layout="NHWC")
    assert refused(nhwc, layout="NHWC") == (
        "The spec's layout is NHWC, but Kiln feeds a classify model NCHW pixels; "
        "export it channels-first, [N, 3, H, W]."
    )


def test_channels_other_than_three() -> None:
    grey = image_model(("N", 1, 32, 32))
    assert refused(grey) == "The input has 1 channels in NCHW layout; expected 3."


@pytest.mark.parametrize(
    ("kind", "in_type", "found"),
    [
        ("classify", TensorProto.UINT8, "uint8"),
        ("classify", TensorProto.FLOAT16, "float16"),  # the classifier feeds float32 only
        ("embed", TensorProto.INT8, "int8"),
        ("embed", TensorProto.DOUBLE, "float64"),
    ],
)
def test_an_input_type_kiln_does_not_feed(kind: str, in_type: int, found: str) -> None:
    message = refused(image_model(in_type=in_type), kind)
    assert message.startswith(f"The model's input is {found}, but Kiln feeds a {kind} model")


def test_an_embedder_may_take_float16() -> None:
    data = image_model(in_type=TensorProto.FLOAT16)
    assert check_onnx(data, "embed", spec())["dim"] == 4


def test_classifier_outputs_must_match_the_labels() -> None:
    assert (
        refused(image_model(), labels=["a"]) == "The model has 4 outputs but 1 labels were given."
    )


def test_a_classifier_output_of_rank_one() -> None:
    message = refused(image_model(out=("N",)))
    assert message == (
        "A classifier must output one score per class, [N, classes]; "
        "the model's output shape is [?]."
    )


def test_a_classifier_output_with_unit_spatial_axes() -> None:
    data = image_model(out=("N", 4, 1, 1), rank4=True)
    assert check_onnx(data, "classify", spec())["labels"] == LABELS
    assert "4 outputs but 3 labels" in refused(data, labels=LABELS[:3])


def test_an_undeclared_output_shape_is_inferred_and_checked() -> None:
    data = image_model(out=None)
    assert "4 outputs but 2 labels" in refused(data, labels=["a", "b"])
    assert check_onnx(data, "embed", spec())["dim"] == 4


def test_an_output_that_is_not_float() -> None:
    message = refused(image_model(out_type=TensorProto.INT64))
    assert message.startswith("The model's output is int64; Kiln reads float32, float16 or float64")


def test_an_embedder_needs_a_fixed_width() -> None:
    assert refused(pixel_embedder(), "embed") == (
        "An embedder must output [N, D] with a fixed D; the model's output shape is [?, ?]."
    )
    assert "output shape is [?, 4, 1, 1]" in refused(
        image_model(out=("N", 4, 1, 1), rank4=True), "embed"
    )


@pytest.mark.parametrize(("asked", "stored"), [(None, 1), (16, 1)])
def test_a_fixed_batch_of_one_is_stored(asked: int | None, stored: int) -> None:
    data = image_model((1, 3, 32, 32), (1, 4))
    assert check_onnx(data, "classify", spec(max_batch=asked))["max_batch"] == stored


def test_a_fixed_batch_is_never_split() -> None:
    data = image_model((8, 3, 32, 32), (8, 4))
    assert check_onnx(data, "classify", spec(max_batch=32))["max_batch"] == 8
    assert refused(data, max_batch=4) == (
        "The model's batch axis is fixed at 8 rows, but max_batch is 4; "
        "leave max_batch out (a fixed batch is used as it is)."
    )


def test_a_dynamic_batch_keeps_the_asked_max_batch() -> None:
    assert check_onnx(image_model(), "classify", spec(max_batch=12))["max_batch"] == 12


def test_weights_in_external_files_are_refused() -> None:
    model = onnx.load_from_string(image_model())
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    message = refused(model.SerializeToString())
    assert message.startswith("The model keeps its weights in external data files")


def test_two_image_inputs_are_refused() -> None:
    model = onnx.load_from_string(image_model())
    extra = helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", 3, 32, 32])
    model.graph.input.append(extra)
    assert "one 4-D image input" in refused(model.SerializeToString())


def test_not_onnx_at_all() -> None:
    assert refused(b"not a model").startswith("The file is not a readable ONNX model")
