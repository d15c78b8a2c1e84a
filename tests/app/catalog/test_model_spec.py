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

from kiln.app.catalog.model_spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageModelSpec,
    Preprocessing,
    check_onnx,
)
from kiln.app.core.errors import InputError
from tests.models import colour_classifier
from tests.workers.models.yolo import LABELS as YOLO_LABELS
from tests.workers.models.yolo import SIZE, tiny_yolo

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


@pytest.mark.parametrize("kind", ["classify", "embed"])
def test_every_image_family_may_be_fed_nhwc(kind: str) -> None:
    nhwc = image_model(("N", 32, 32, 3), layout="NHWC")
    assert check_onnx(nhwc, kind, spec(layout="NHWC"))["layout"] == "NHWC"


def test_channels_other_than_three() -> None:
    grey = image_model(("N", 1, 32, 32))
    assert refused(grey) == "The input has 1 channels in NCHW layout; expected 3."


@pytest.mark.parametrize(
    ("kind", "in_type", "found"),
    [
        ("classify", TensorProto.UINT8, "uint8"),
        ("embed", TensorProto.INT8, "int8"),
        ("embed", TensorProto.DOUBLE, "float64"),
    ],
)
def test_an_input_type_kiln_does_not_feed(kind: str, in_type: int, found: str) -> None:
    message = refused(image_model(in_type=in_type), kind)
    assert message.startswith(f"The model's input is {found}, but Kiln feeds a {kind} model")


def test_a_model_may_take_float16() -> None:
    data = image_model(in_type=TensorProto.FLOAT16)
    assert check_onnx(data, "embed", spec())["dim"] == 4
    assert check_onnx(data, "classify", spec())["labels"] == LABELS


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


# ---------------------------------------------------------------- declared preprocessing


def test_a_spec_stored_before_declared_preprocessing_reads_back_as_before() -> None:
    old = {"input_size": 224, "labels": LABELS, "mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2],
           "layout": "NCHW", "top_k": 5, "max_batch": None, "fp16": False, "description": "",
           "dim": 4}  # fmt: skip
    for kind in ("classify", "embed"):
        assert ImageModelSpec.from_dict(old).preprocessing(kind) == Preprocessing(
            input_size=224,
            fit="crop",
            resize_filter="bilinear",
            crop_ratio=0.875,
            mean=(0.5, 0.5, 0.5),
            std=(0.2, 0.2, 0.2),
            channel_order="RGB",
            pixel_range="0-1",
            layout="NCHW",
        )


def test_the_stored_spec_fills_in_the_familys_defaults(tmp_path: Path) -> None:
    colour_classifier(tmp_path / "c.onnx")
    stored = check_onnx((tmp_path / "c.onnx").read_bytes(), "classify", spec())
    assert {k: stored[k] for k in ("fit", "resize_filter", "crop_ratio", "mean", "std")} == {
        "fit": "crop",
        "resize_filter": "bilinear",
        "crop_ratio": 0.875,
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
    }
    assert (stored["channel_order"], stored["pixel_range"]) == ("RGB", "0-1")
    assert "score_threshold" not in stored and "max_boxes" not in stored


def test_declared_preprocessing_is_stored(tmp_path: Path) -> None:
    colour_classifier(tmp_path / "c.onnx")
    declared = spec(fit="squash", resize_filter="bicubic", channel_order="BGR",
                    pixel_range="0-255", mean=(1.0, 2.0, 3.0), std=(50.0, 60.0, 70.0))  # fmt: skip
    stored = check_onnx((tmp_path / "c.onnx").read_bytes(), "classify", declared)
    assert ImageModelSpec.from_dict(stored).preprocessing("classify") == Preprocessing(
        32, "squash", "bicubic", 0.875, (1.0, 2.0, 3.0), (50.0, 60.0, 70.0), "BGR", "0-255"
    )


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"fit": "stretch"}, "fit must be crop, squash or letterbox, not 'stretch'."),
        ({"resize_filter": "box"}, "resize_filter must be bilinear, bicubic, lanczos or nearest"),
        ({"channel_order": "GBR"}, "channel_order must be RGB or BGR, not 'GBR'."),
        ({"pixel_range": "0-65535"}, "pixel_range must be 0-1 or 0-255, not '0-65535'."),
        ({"layout": "CHWN"}, "layout must be NCHW or NHWC, not 'CHWN'."),
        ({"crop_ratio": 1.2}, "crop_ratio must be above 0 and at most 1"),
        ({"crop_ratio": 0.0}, "crop_ratio must be above 0 and at most 1"),
        (
            {"mean": (123.675, 116.28, 103.53), "std": (58.4, 57.1, 57.4)},
            "mean [123.675, 116.28, 103.53] is on the 0-255 scale, but pixel_range is 0-1; "
            "set pixel_range to 0-255 or give mean and std divided by 255.",
        ),
        ({"pixel_range": "0-255"}, "pixel_range is 0-255 but mean and std are ImageNet's 0-1"),
        ({"score_threshold": 0.5}, "score_threshold, iou_threshold and max_boxes are for detect"),
    ],
)
def test_a_declared_choice_kiln_cannot_make(change: dict[str, Any], sentence: str) -> None:
    assert sentence in refused(image_model(), **change)


# ---------------------------------------------------------------- detectors


def detect_spec(**change: Any) -> ImageModelSpec:
    return ImageModelSpec(**{"input_size": SIZE, "labels": YOLO_LABELS, **change})


def detect_refused(data: bytes, **change: Any) -> str:
    with pytest.raises(InputError) as caught:
        check_onnx(data, "detect", detect_spec(**change))
    return str(caught.value)


def test_a_detector_is_stored_with_yolo_defaults(tmp_path: Path) -> None:
    stored = check_onnx(tiny_yolo(tmp_path / "y.onnx").read_bytes(), "detect", detect_spec())
    assert stored["fit"] == "letterbox" and stored["labels"] == YOLO_LABELS
    assert (stored["mean"], stored["std"]) == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    assert (stored["score_threshold"], stored["iou_threshold"], stored["max_boxes"]) == (
        0.25, 0.45, 300
    )  # fmt: skip


def test_a_detectors_labels_must_match_its_class_scores(tmp_path: Path) -> None:
    data = tiny_yolo(tmp_path / "y.onnx").read_bytes()
    assert detect_refused(data, labels=["a", "b", "c"]) == (
        "The model's output has 6 values per anchor (4 for the box, 2 class scores), "
        "but 3 labels were given."
    )
    assert detect_refused(data, labels=[]) == (
        "A detector needs labels: one per class score, in order."
    )


def test_a_detector_with_anchors_first_is_refused(tmp_path: Path) -> None:
    data = tiny_yolo(tmp_path / "y.onnx", anchors_first=True).read_bytes()
    assert detect_refused(data) == (
        "The model's output is [?, 3, 6], anchors first; Kiln reads "
        "[N, 4 + classes, anchors]: transpose the output in the graph."
    )


def test_a_detector_output_of_another_rank(tmp_path: Path) -> None:
    colour_classifier(tmp_path / "c.onnx")
    assert detect_refused((tmp_path / "c.onnx").read_bytes(), input_size=32) == (
        "A detector must output [N, 4 + classes, anchors] (YOLOv8 style); the model's "
        "output shape is [?, 4]."
    )


def test_a_detector_input_size_and_layout(tmp_path: Path) -> None:
    data = tiny_yolo(tmp_path / "y.onnx").read_bytes()
    assert "input is 32 pixels a side, but input_size is 640" in detect_refused(
        data, input_size=640
    )
    assert "laid out NCHW, but the spec's layout is NHWC" in detect_refused(data, layout="NHWC")
    nhwc = tiny_yolo(tmp_path / "n.onnx", layout="NHWC").read_bytes()
    assert check_onnx(nhwc, "detect", detect_spec(layout="NHWC"))["layout"] == "NHWC"


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"fit": "crop"}, "its fit must be letterbox or squash; crop would cut"),
        ({"score_threshold": 1.5}, "score_threshold must be between 0 and 1."),
        ({"iou_threshold": -0.1}, "iou_threshold must be between 0 and 1."),
        ({"max_boxes": 0}, "max_boxes must be between 1 and 10000."),
    ],
)
def test_a_detector_setting_out_of_range(
    tmp_path: Path, change: dict[str, Any], sentence: str
) -> None:
    assert sentence in detect_refused(tiny_yolo(tmp_path / "y.onnx").read_bytes(), **change)


def test_a_detector_may_squash(tmp_path: Path) -> None:
    data = tiny_yolo(tmp_path / "y.onnx").read_bytes()
    stored = check_onnx(data, "detect", detect_spec(fit="squash", max_boxes=5))
    assert (stored["fit"], stored["max_boxes"]) == ("squash", 5)


# --- refuse_below: a classifier's confidence floor ------------------------------------------


@pytest.mark.parametrize("floor", [0, 0.5, 1])
def test_a_classifier_stores_its_refusal_floor(tmp_path: Path, floor: float) -> None:
    colour_classifier(tmp_path / "c.onnx")
    stored = check_onnx((tmp_path / "c.onnx").read_bytes(), "classify", spec(refuse_below=floor))
    assert stored["refuse_below"] == floor
    assert ImageModelSpec.from_dict(stored).refuse_below == floor


def test_a_classifier_without_a_floor_stores_none(tmp_path: Path) -> None:
    colour_classifier(tmp_path / "c.onnx")
    stored = check_onnx((tmp_path / "c.onnx").read_bytes(), "classify", spec())
    assert stored["refuse_below"] is None
    assert ImageModelSpec.from_dict({"input_size": 32}).refuse_below is None  # stored before it


@pytest.mark.parametrize("floor", [-0.1, 1.5, float("nan"), True])
def test_a_floor_outside_zero_to_one_is_refused(tmp_path: Path, floor: object) -> None:
    colour_classifier(tmp_path / "c.onnx")
    sentence = refused((tmp_path / "c.onnx").read_bytes(), refuse_below=floor)
    assert sentence == (
        f"refuse_below must be a score from 0 to 1 (the top label's softmax probability), "
        f"not {floor!r}."
    )


def test_only_a_classifier_may_refuse(tmp_path: Path) -> None:
    data = tiny_yolo(tmp_path / "y.onnx").read_bytes()
    assert detect_refused(data, refuse_below=0.5) == (
        "refuse_below is for classify models: a floor under their top score."
    )
    assert "refuse_below" not in check_onnx(data, "detect", detect_spec())
