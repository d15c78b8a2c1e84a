"""How to feed a registered image model, and the checks its ONNX file must pass at registration.

Checked once, when a model is registered, so a bad file or a spec that does not fit the graph
is a 4xx with a sentence then — not a failed item for every input later. A spec stored before
a field existed reads back with that field's default, which is what Kiln did before the field.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, get_args

from kiln.app.core.errors import InputError

log = logging.getLogger(__name__)

Layout = Literal["NCHW", "NHWC"]
Fit = Literal["crop", "squash", "letterbox"]  # resize-then-centre-crop, plain resize, pad
Filter = Literal["bilinear", "bicubic", "lanczos", "nearest"]
ChannelOrder = Literal["RGB", "BGR"]
PixelRange = Literal["0-1", "0-255"]
Triple = tuple[float, float, float]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CROP_RATIO = 0.875  # the centre crop keeps 224 of 256 pixels, as ImageNet models expect
IMAGE_KINDS = ("classify", "embed", "detect")


@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes one model input, every choice made: fitted into `input_size`
    square by `fit` with `resize_filter`, channels put in `channel_order`, then
    (pixel · scale − mean) / std with pixels read 0–1 or 0–255, laid out `layout`. mean and
    std are given in the model's channel order and pixel range."""

    input_size: int
    fit: Fit = "crop"
    resize_filter: Filter = "bilinear"
    crop_ratio: float = CROP_RATIO
    mean: Triple = IMAGENET_MEAN
    std: Triple = IMAGENET_STD
    channel_order: ChannelOrder = "RGB"
    pixel_range: PixelRange = "0-1"
    layout: Layout = "NCHW"

    @property
    def scale(self) -> float:
        """What a uint8 pixel is multiplied by before mean and std are applied."""
        return 1 / 255 if self.pixel_range == "0-1" else 1.0


@dataclass(frozen=True)
class Detection:
    """How a detector's raw boxes become its answer: the score floor, the overlap above which
    NMS drops the weaker box, and the most boxes kept per image (None: all of them)."""

    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    max_boxes: int | None = 300


# What a field left out means, per family: a detector (YOLO) is letterboxed and only scaled
# to 0–1; the others are centre-cropped and normalised with ImageNet's mean and std.
_IMAGENET = {"fit": "crop", "mean": IMAGENET_MEAN, "std": IMAGENET_STD}
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "classify": _IMAGENET,
    "embed": _IMAGENET,
    "detect": {"fit": "letterbox", "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)},
}
DETECTION_FIELDS = ("score_threshold", "iou_threshold", "max_boxes")


@dataclass(frozen=True)
class ImageModelSpec:
    """A registered image model's spec as declared. Fields left None take their family's
    default (`preprocessing`, `detection`); the stored spec has every default filled in."""

    input_size: int
    labels: list[str] = field(default_factory=list)
    mean: Triple | None = None
    std: Triple | None = None
    layout: Layout = "NCHW"
    top_k: int = 5
    max_batch: int | None = None
    fp16: bool = False  # embeddings stored as float16 (half the size, ~3 significant digits)
    description: str = ""
    fit: Fit | None = None
    resize_filter: Filter = "bilinear"
    crop_ratio: float = CROP_RATIO
    channel_order: ChannelOrder = "RGB"
    pixel_range: PixelRange = "0-1"
    score_threshold: float | None = None  # this and the next two: detect only
    iou_threshold: float | None = None
    max_boxes: int | None = None
    # classify only: an input whose top score is below it is refused ("no answer"), which a
    # job's fallback may take; None: every answer stands.
    refuse_below: float | None = None

    @classmethod
    def from_dict(cls, given: Mapping[str, Any]) -> ImageModelSpec:
        """A spec from JSON values (a stored spec, the CLI's options); keys it does not know
        (the `dim` a graph added) are left out, keys it lacks take their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in given.items() if k in known}
        for key in ("mean", "std"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        values["labels"] = list(values.get("labels") or [])
        return cls(**values)

    def preprocessing(self, kind: str) -> Preprocessing:
        defaults = _FAMILY_DEFAULTS[kind]
        return Preprocessing(
            input_size=self.input_size,
            fit=self.fit or defaults["fit"],
            resize_filter=self.resize_filter,
            crop_ratio=self.crop_ratio,
            mean=self.mean or defaults["mean"],
            std=self.std or defaults["std"],
            channel_order=self.channel_order,
            pixel_range=self.pixel_range,
            layout=self.layout,
        )

    def detection(self) -> Detection:
        default = Detection()
        return Detection(
            default.score_threshold if self.score_threshold is None else self.score_threshold,
            default.iou_threshold if self.iou_threshold is None else self.iou_threshold,
            default.max_boxes if self.max_boxes is None else self.max_boxes,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_size": self.input_size,
            "labels": list(self.labels),
            "mean": None if self.mean is None else list(self.mean),
            "std": None if self.std is None else list(self.std),
            "layout": self.layout,
            "top_k": self.top_k,
            "max_batch": self.max_batch,
            "fp16": self.fp16,
            "description": self.description,
            "fit": self.fit,
            "resize_filter": self.resize_filter,
            "crop_ratio": self.crop_ratio,
            "channel_order": self.channel_order,
            "pixel_range": self.pixel_range,
            **{name: getattr(self, name) for name in DETECTION_FIELDS},
            "refuse_below": self.refuse_below,
        }

    def stored(self, kind: str) -> dict[str, Any]:
        """What registration stores: the spec with its family's defaults filled in, the
        detection settings for a detector only, the refusal floor for a classifier only."""
        filled = {**self.as_dict(), **_jsonable(asdict(self.preprocessing(kind)))}
        for name in DETECTION_FIELDS:
            filled.pop(name)
        if kind != "classify":
            filled.pop("refuse_below")
        if kind == "detect":
            filled.update(asdict(self.detection()))
        return filled


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


# What the pipelines feed (workers/models/image_model.py): pixels normalised in the spec's
# layout, float16 when the graph takes float16, else float32. A model fed anything else
# fails every item, so it is refused here.
INPUT_TYPES = ("float32", "float16")
OUTPUT_TYPES = ("float32", "float16", "float64")  # scores, vectors and boxes are read as floats


def _dims(value_info: Any) -> list[int | None]:
    """The tensor's dimensions; a symbolic or unset one (dynamic) is None."""
    return [
        d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
        for d in value_info.type.tensor_type.shape.dim
    ]


def _output_dims(value_info: Any) -> list[int | None] | None:
    """The output's dimensions, or None when the graph does not give even its rank."""
    return _dims(value_info) if value_info.type.tensor_type.HasField("shape") else None


def _shape(dims: list[int | None] | None) -> str:
    if dims is None:
        return "not declared"
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _type(value_info: Any) -> str:
    """The element type as NumPy names it (float32, uint8, …)."""
    import onnx

    if not value_info.type.HasField("tensor_type"):
        return "not a tensor"
    elem_type = value_info.type.tensor_type.elem_type
    named = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}
    try:
        return named.get(elem_type) or onnx.TensorProto.DataType.Name(elem_type).lower()
    except ValueError:  # a number no ONNX version defines
        return f"type {elem_type}"


def check_onnx(data: bytes, kind: str, spec: ImageModelSpec) -> dict[str, Any]:
    """Validate the graph against the spec; returns the spec to store (with its family's
    defaults and what the graph fixes: the embedding size, a static batch size)."""
    _check_spec(kind, spec)
    graph = _load_graph(data)
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(_dims(inputs[0])) != 4:
        raise InputError(
            "An image model must take one 4-D image input, [N, 3, H, W] or [N, H, W, 3]."
        )
    shape = _dims(inputs[0])
    _check_feed(kind, _type(inputs[0]))
    _check_layout(shape, spec.layout)
    _check_size(shape, spec.layout, spec.input_size)
    stored = spec.stored(kind)
    stored["max_batch"] = _max_batch(shape[0], spec.max_batch)
    if not graph.output:
        raise InputError("The model declares no output.")
    output, out_type = _output_dims(graph.output[0]), _type(graph.output[0])
    if out_type not in OUTPUT_TYPES:
        raise InputError(
            f"The model's output is {out_type}; Kiln reads float32, float16 or float64 "
            f"scores, vectors or boxes from it."
        )
    if kind == "classify":
        _check_classes(output, spec)
    if kind == "detect":
        _check_boxes(output, spec)
    if kind == "embed":
        stored["dim"] = _embedding_size(output)
    return stored


def _load_graph(data: bytes) -> Any:
    import onnx

    try:
        model = onnx.load_from_string(data)
    except Exception as error:  # onnx raises DecodeError and friends
        raise InputError(f"The file is not a readable ONNX model: {error}.") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        # Only this one file is stored: weights kept beside it would be missing on every worker.
        raise InputError(
            "The model keeps its weights in external data files; save it as one file "
            "(onnx.save_model(model, path, save_as_external_data=False))."
        )
    try:  # fills in output shapes an exporter left out, so they can be checked too
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a help: the declared shapes still count
        log.debug("shape inference failed; checking the declared shapes", exc_info=True)
    return model.graph


def _check_feed(kind: str, found: str) -> None:
    if found not in INPUT_TYPES:
        raise InputError(
            f"The model's input is {found}, but Kiln feeds a {kind} model "
            f"{' or '.join(INPUT_TYPES)} pixels (normalised with mean and std)."
        )


def _check_layout(shape: list[int | None], layout: str) -> None:
    channels, other = (shape[1], shape[3]) if layout == "NCHW" else (shape[3], shape[1])
    if other == 3 and channels != 3:  # the graph is laid out the other way round
        swapped = "NHWC" if layout == "NCHW" else "NCHW"
        raise InputError(
            f"The model's input is {_shape(shape)}, laid out {swapped}, "
            f"but the spec's layout is {layout}."
        )
    if channels not in (None, 3):
        raise InputError(f"The input has {channels} channels in {layout} layout; expected 3.")


def _check_size(shape: list[int | None], layout: str, input_size: int) -> None:
    """Kiln feeds input_size × input_size pixels: a fixed height or width must be that."""
    height, width = (shape[2], shape[3]) if layout == "NCHW" else (shape[1], shape[2])
    if height is not None and width is not None and height != width:
        raise InputError(
            f"The model's input is {height}×{width} pixels (height×width), but Kiln feeds "
            f"square images of input_size × input_size."
        )
    fixed = height if height is not None else width
    if fixed is not None and fixed != input_size:
        raise InputError(
            f"The model's input is {fixed} pixels a side, but input_size is {input_size}; "
            f"register it with input_size {fixed}."
        )


def _max_batch(fixed: int | None, requested: int | None) -> int | None:
    """A static batch axis is what the engine runs: never more rows, and never fewer."""
    if fixed is None:
        return requested
    if requested is not None and requested < fixed:
        raise InputError(
            f"The model's batch axis is fixed at {fixed} rows, but max_batch is {requested}; "
            f"leave max_batch out (a fixed batch is used as it is)."
        )
    return fixed


def _check_classes(output: list[int | None] | None, spec: ImageModelSpec) -> None:
    if output is None:  # an undeclared shape cannot contradict the labels
        return
    if len(output) < 2:
        raise InputError(
            f"A classifier must output one score per class, [N, classes]; "
            f"the model's output shape is {_shape(output)}."
        )
    per_row = [d for d in output[1:] if d is not None]
    width = math.prod(per_row)  # [N, C] or [N, C, 1, 1]: the pipeline flattens each row
    if len(per_row) == len(output) - 1 and width != len(spec.labels):
        raise InputError(f"The model has {width} outputs but {len(spec.labels)} labels were given.")


def _check_boxes(output: list[int | None] | None, spec: ImageModelSpec) -> None:
    """A YOLOv8-style head: [N, 4 + classes, anchors], box centre and size then one score per
    class for every anchor (what `workers/models/detect.decode_yolo` reads)."""
    if output is None:  # an undeclared shape cannot contradict the labels
        return
    rows = 4 + len(spec.labels)
    if len(output) != 3:
        raise InputError(
            f"A detector must output [N, 4 + classes, anchors] (YOLOv8 style); the model's "
            f"output shape is {_shape(output)}."
        )
    if output[1] is not None and output[1] != rows and output[2] == rows:
        raise InputError(
            f"The model's output is {_shape(output)}, anchors first; Kiln reads "
            f"[N, 4 + classes, anchors]: transpose the output in the graph."
        )
    if output[1] is not None and output[1] != rows:
        raise InputError(
            f"The model's output has {output[1]} values per anchor (4 for the box, "
            f"{output[1] - 4} class scores), but {len(spec.labels)} labels were given."
        )


def _embedding_size(output: list[int | None] | None) -> int:
    if output is None or len(output) != 2 or output[1] is None:
        raise InputError(
            f"An embedder must output [N, D] with a fixed D; the model's output shape is "
            f"{_shape(output)}."
        )
    return output[1]


def _check_spec(kind: str, spec: ImageModelSpec) -> None:
    if kind not in IMAGE_KINDS:
        raise InputError(f"Kind {kind!r} is not an image model; use one of {IMAGE_KINDS}.")
    if not 8 <= spec.input_size <= 4096:
        raise InputError("input_size must be between 8 and 4096 pixels.")
    if spec.max_batch is not None and not 1 <= spec.max_batch <= 4096:
        raise InputError("max_batch must be between 1 and 4096.")
    if not 1 <= spec.top_k <= 1000:
        raise InputError("top_k must be between 1 and 1000.")
    _check_choices(spec)
    _check_pixels(spec.preprocessing(kind))
    _check_family(kind, spec)


_CHOICES = {
    "layout": Layout,
    "fit": Fit,
    "resize_filter": Filter,
    "channel_order": ChannelOrder,
    "pixel_range": PixelRange,
}


def _check_choices(spec: ImageModelSpec) -> None:
    for name, choices in _CHOICES.items():
        value, allowed = getattr(spec, name), get_args(choices)
        if value is not None and value not in allowed:
            named = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
            raise InputError(f"{name} must be {named}, not {value!r}.")
    if not 0 < spec.crop_ratio <= 1:
        raise InputError(
            "crop_ratio must be above 0 and at most 1: the share of the resized short side "
            "that the centre crop keeps."
        )


def _check_pixels(pre: Preprocessing) -> None:
    if any(s == 0 for s in pre.std):
        raise InputError("std must not contain 0 (inputs are divided by it).")
    if pre.pixel_range == "0-1" and max(abs(m) for m in pre.mean) > 1.5:
        raise InputError(
            f"mean {list(pre.mean)} is on the 0-255 scale, but pixel_range is 0-1; set "
            f"pixel_range to 0-255 or give mean and std divided by 255."
        )
    if pre.pixel_range == "0-255" and (pre.mean, pre.std) == (IMAGENET_MEAN, IMAGENET_STD):
        raise InputError(
            "pixel_range is 0-255 but mean and std are ImageNet's 0-1 values; give them on "
            "the 0-255 scale (mean 123.675,116.28,103.53 and std 58.395,57.12,57.375)."
        )


def _check_family(kind: str, spec: ImageModelSpec) -> None:
    if kind == "classify" and not spec.labels:
        raise InputError("A classifier needs labels: one per output, in order.")
    _check_refusal(kind, spec.refuse_below)
    if kind != "detect":
        if any(getattr(spec, name) is not None for name in DETECTION_FIELDS):
            raise InputError("score_threshold, iou_threshold and max_boxes are for detect models.")
        return
    if not spec.labels:
        raise InputError("A detector needs labels: one per class score, in order.")
    if spec.fit == "crop":
        raise InputError(
            "A detector's boxes are mapped back onto the whole image, so its fit must be "
            "letterbox or squash; crop would cut the image's edges off."
        )
    found = spec.detection()
    for name in ("score_threshold", "iou_threshold"):
        if not 0 <= getattr(found, name) <= 1:
            raise InputError(f"{name} must be between 0 and 1.")
    if found.max_boxes is not None and not 1 <= found.max_boxes <= 10_000:
        raise InputError("max_boxes must be between 1 and 10000.")


def _check_refusal(kind: str, floor: float | None) -> None:
    if floor is None:
        return
    if kind != "classify":
        raise InputError("refuse_below is for classify models: a floor under their top score.")
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
        raise InputError(
            f"refuse_below must be a score from 0 to 1 (the top label's softmax probability), "
            f"not {floor!r}."
        )
