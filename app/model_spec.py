"""How to feed a registered image model, and the checks its ONNX file must pass at registration.

Checked once, when a model is registered, so a bad file or a spec that does not fit the graph
is a 4xx with a sentence then — not a failed item for every input later.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.app.core.errors import InputError

log = logging.getLogger(__name__)

Layout = Literal["NCHW", "NHWC"]
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class ImageModelSpec:
    input_size: int
    labels: list[str] = field(default_factory=list)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    layout: Layout = "NCHW"
    top_k: int = 5
    max_batch: int | None = None
    fp16: bool = False  # embeddings stored as float16 (half the size, ~3 significant digits)
    description: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_size": self.input_size,
            "labels": list(self.labels),
            "mean": list(self.mean),
            "std": list(self.std),
            "layout": self.layout,
            "top_k": self.top_k,
            "max_batch": self.max_batch,
            "fp16": self.fp16,
            "description": self.description,
        }


# What the pipelines feed (workers/models/image_model.py, classify.py, embed.py): pixels
# normalised to float32, NCHW; an embedder also in its spec's layout, and in float16 when its
# graph takes float16. A model fed anything else fails every item, so it is refused here.
INPUT_TYPES = {"classify": ("float32",), "embed": ("float32", "float16")}
LAYOUTS = {"classify": ("NCHW",), "embed": ("NCHW", "NHWC")}
OUTPUT_TYPES = ("float32", "float16", "float64")  # scores and vectors are read as floats


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
    """Validate the graph against the spec; returns the spec to store (with what the graph
    fixes: the embedding size, a static batch size)."""
    _check_spec(kind, spec)
    graph = _load_graph(data)
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(_dims(inputs[0])) != 4:
        raise InputError(
            "An image model must take one 4-D image input, [N, 3, H, W] or [N, H, W, 3]."
        )
    shape = _dims(inputs[0])
    _check_feed(kind, _type(inputs[0]), spec.layout)
    _check_layout(shape, spec)
    _check_size(shape, spec)
    stored = spec.as_dict()
    stored["max_batch"] = _max_batch(shape[0], spec.max_batch)
    if not graph.output:
        raise InputError("The model declares no output.")
    output, out_type = _output_dims(graph.output[0]), _type(graph.output[0])
    if out_type not in OUTPUT_TYPES:
        raise InputError(
            f"The model's output is {out_type}; Kiln reads float32, float16 or float64 "
            f"scores or vectors from it."
        )
    if kind == "classify":
        _check_classes(output, spec)
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


def _check_feed(kind: str, found: str, layout: str) -> None:
    accepted = INPUT_TYPES[kind]
    if found not in accepted:
        raise InputError(
            f"The model's input is {found}, but Kiln feeds a {kind} model "
            f"{' or '.join(accepted)} pixels (normalised with mean and std)."
        )
    if layout not in LAYOUTS[kind]:
        raise InputError(
            f"The spec's layout is {layout}, but Kiln feeds a {kind} model "
            f"{' or '.join(LAYOUTS[kind])} pixels; export it channels-first, [N, 3, H, W]."
        )


def _check_layout(shape: list[int | None], spec: ImageModelSpec) -> None:
    channels, other = (shape[1], shape[3]) if spec.layout == "NCHW" else (shape[3], shape[1])
    if other == 3 and channels != 3:  # the graph is laid out the other way round
        swapped = "NHWC" if spec.layout == "NCHW" else "NCHW"
        raise InputError(
            f"The model's input is {_shape(shape)}, laid out {swapped}, "
            f"but the spec's layout is {spec.layout}."
        )
    if channels not in (None, 3):
        raise InputError(f"The input has {channels} channels in {spec.layout} layout; expected 3.")


def _check_size(shape: list[int | None], spec: ImageModelSpec) -> None:
    """Kiln feeds input_size × input_size pixels: a fixed height or width must be that."""
    height, width = (shape[2], shape[3]) if spec.layout == "NCHW" else (shape[1], shape[2])
    if height is not None and width is not None and height != width:
        raise InputError(
            f"The model's input is {height}×{width} pixels (height×width), but Kiln feeds "
            f"square images of input_size × input_size."
        )
    fixed = height if height is not None else width
    if fixed is not None and fixed != spec.input_size:
        raise InputError(
            f"The model's input is {fixed} pixels a side, but input_size is {spec.input_size}; "
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


def _embedding_size(output: list[int | None] | None) -> int:
    if output is None or len(output) != 2 or output[1] is None:
        raise InputError(
            f"An embedder must output [N, D] with a fixed D; the model's output shape is "
            f"{_shape(output)}."
        )
    return output[1]


def _check_spec(kind: str, spec: ImageModelSpec) -> None:
    if not 8 <= spec.input_size <= 4096:
        raise InputError("input_size must be between 8 and 4096 pixels.")
    if any(s == 0 for s in spec.std):
        raise InputError("std must not contain 0 (inputs are divided by it).")
    if spec.layout not in ("NCHW", "NHWC"):
        raise InputError("layout must be NCHW or NHWC.")
    if kind == "classify" and not spec.labels:
        raise InputError("A classifier needs labels: one per output, in order.")
    if spec.max_batch is not None and not 1 <= spec.max_batch <= 4096:
        raise InputError("max_batch must be between 1 and 4096.")
    if not 1 <= spec.top_k <= 1000:
        raise InputError("top_k must be between 1 and 1000.")
