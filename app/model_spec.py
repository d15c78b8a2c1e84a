"""How to feed a registered image model, and the checks its ONNX file must pass at registration.

Checked once, when a model is registered, so a bad file or a spec that does not fit the graph
is a 4xx with a sentence then — not a failed item for every input later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kiln.app.core.errors import InputError

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


def _dims(value_info: Any) -> list[int | None]:
    return [
        d.dim_value if d.HasField("dim_value") else None
        for d in value_info.type.tensor_type.shape.dim
    ]


def check_onnx(data: bytes, kind: str, spec: ImageModelSpec) -> dict[str, Any]:
    """Validate the graph against the spec; returns the spec to store (with what the graph
    fixes: the embedding size, a static batch size)."""
    import onnx

    _check_spec(kind, spec)
    try:
        graph = onnx.load_from_string(data).graph
    except Exception as error:  # onnx raises DecodeError and friends
        raise InputError(f"The file is not a readable ONNX model: {error}.") from None
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    if len(inputs) != 1 or len(_dims(inputs[0])) != 4:
        raise InputError(
            "An image model must take one 4-D image input, [N, 3, H, W] or [N, H, W, 3]."
        )
    shape = _dims(inputs[0])
    channels = shape[1] if spec.layout == "NCHW" else shape[3]
    if channels not in (None, 3):
        raise InputError(f"The input has {channels} channels in {spec.layout} layout; expected 3.")
    stored = spec.as_dict()
    if shape[0] is not None:  # a static batch axis: the engine cannot take more rows at once
        stored["max_batch"] = min(shape[0], spec.max_batch or shape[0])
    width = _dims(graph.output[0])[-1] if graph.output else None
    if kind == "classify" and width is not None and width != len(spec.labels):
        raise InputError(f"The model has {width} outputs but {len(spec.labels)} labels were given.")
    if kind == "embed":
        if width is None or len(_dims(graph.output[0])) != 2:
            raise InputError("An embedder must output [N, D] with a fixed D.")
        stored["dim"] = width
    return stored


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
