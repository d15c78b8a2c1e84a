"""The uint8 input contract as ONNX nodes: an image model's float input becomes uint8 NHWC RGB
pixels, normalised by nodes prepended to the graph, so TensorRT and ONNX Runtime CUDA fuse the
normalisation into the first layers and only a quarter of the float32 batch crosses the bus.

The prepended nodes compute exactly what `Normalization.__call__` computes with NumPy:

    uint8 (N, H, W, 3) → Cast float32 → [Gather [2, 1, 0] on axis 3, for BGR]
        → Mul gain → Add shift → [Transpose to NCHW] → [Cast float16]

The Cast comes first because TensorRT lets a UINT8 network input feed nothing but a cast.
`prepended_path` writes the result once beside the model cache (its name carries the original
file's sha256, hashed once per version of that file: `learned.known_sha256`), so TensorRT's
plan key — the sha256 of the file it builds from — changes with both the model and the
normalisation.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.app.core.digest import sha256_hex
from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.learned import Learned, known_sha256
from kiln.workers.engines.uint8_input import Normalization

if TYPE_CHECKING:
    import onnx

# `onnx` is imported where a graph is built: choosing the file (`engine_onnx`) on a CPU host,
# where nothing is prepended, costs no import (as in `tensorrt_logic`).

# Bump when the prepended nodes change: the cached files' names then change with it.
SCHEME = "uint8-v1"
_MIN_OPSET = 7  # numpy-style broadcasting in Mul and Add
Step = tuple[str, dict[str, Any], list[str]]  # op type, attributes, inputs after the previous


def prepend(model: onnx.ModelProto, norm: Normalization) -> onnx.ModelProto:
    """A copy of `model` whose single image input takes uint8 NHWC pixels (same name) and
    normalises them with `norm` before the original graph. Raises ValueError with a sentence
    for a model this cannot apply to."""
    import onnx
    from onnx import helper

    _check_norm(norm)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    original = _image_input(graph, norm)
    _check_opset(out)
    internal = _unused_name(graph, f"{original.name}__normalized")
    _rename_uses(graph, original.name, internal)
    elem_type = original.type.tensor_type.elem_type
    nodes, weights = _normalize_nodes(original.name, internal, norm, elem_type, graph)
    for index, node in enumerate(nodes):
        graph.node.insert(index, node)
    graph.initializer.extend(weights)
    _replace_input(graph, original, _uint8_input(original, norm))
    helper.set_model_props(
        out, {**{p.key: p.value for p in out.metadata_props}, "kiln.uint8_input": _describe(norm)}
    )
    onnx.checker.check_model(out)
    return out


def prepended_path(onnx_path: Path, norm: Normalization, cache_dir: Path) -> Path:
    """`prepend` applied to the file at `onnx_path`, written once into `cache_dir` as
    `<original sha256>-uint8-<norm digest>.onnx` and reused after that."""
    original = known_sha256(onnx_path, Learned(cache_dir))  # hashed once per file version
    target = cache_dir / f"{original}-uint8-{norm_digest(norm)}.onnx"
    if target.exists():
        return target
    import onnx

    # External data (if any) is read relative to the original and saved inline.
    model = onnx.load(str(onnx_path), load_external_data=True)
    _write_atomically(prepend(model, norm), target)
    return target


def engine_onnx(request: EngineRequest, on_gpu: bool, cache_dir: Path) -> Path:
    """The ONNX file a backend builds `request` from: the prepended one where a GPU engine
    normalises itself (the request carries a normalisation), else the original — a CPU engine
    is fed what the predictor normalised with NumPy."""
    norm = request.normalization
    if not on_gpu or norm is None:
        return Path(request.onnx_path)
    return prepended_path(Path(request.onnx_path), norm, cache_dir)


def for_engine(request: EngineRequest, on_gpu: bool, cache_dir: Path) -> EngineRequest:
    """`request` pointing at `engine_onnx(...)` (the same request when nothing changes)."""
    path = engine_onnx(request, on_gpu, cache_dir)
    return request if path == Path(request.onnx_path) else replace(request, onnx_path=path)


def norm_digest(norm: Normalization) -> str:
    """A short, stable name for `norm` and the prepending scheme."""
    return sha256_hex(_describe(norm))[:16]


# --- the input ----------------------------------------------------------------------------


def _check_norm(norm: Normalization) -> None:
    if norm.channel_order not in ("RGB", "BGR"):
        raise ValueError(f"Unknown channel order {norm.channel_order!r}; use RGB or BGR.")
    if norm.layout not in ("NCHW", "NHWC"):
        raise ValueError(f"Unknown layout {norm.layout!r}; use NCHW or NHWC.")


def _image_input(graph: onnx.GraphProto, norm: Normalization) -> onnx.ValueInfoProto:
    """The graph's one real input, checked to be a 4-D float image in `norm.layout` with fixed
    height, width and 3 channels."""
    from onnx import TensorProto

    floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
    weights = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name not in weights]  # IR < 4 lists weights too
    if len(inputs) != 1:
        names = [i.name for i in inputs]
        raise ValueError(
            f"A uint8 image input needs a model with exactly one input; this one has {names}."
        )
    value: onnx.ValueInfoProto = inputs[0]
    tensor = value.type.tensor_type
    if not value.type.HasField("tensor_type") or tensor.elem_type not in floats:
        raise ValueError(f"Input {value.name!r} is not a float32 or float16 tensor.")
    dims = list(tensor.shape.dim) if tensor.HasField("shape") else []
    if len(dims) != 4:
        raise ValueError(
            f"Input {value.name!r} has rank {len(dims) or 'unknown'}; an image input must be "
            f"4-D ({norm.layout})."
        )
    channels, height, width = (1, 2, 3) if norm.layout == "NCHW" else (3, 1, 2)
    if dims[channels].dim_value != 3:
        raise ValueError(
            f"Input {value.name!r} must have 3 channels on axis {channels} ({norm.layout})."
        )
    if dims[height].dim_value <= 0 or dims[width].dim_value <= 0:
        raise ValueError(f"Input {value.name!r} needs a fixed height and width.")
    if any(o.name == value.name for o in graph.output):
        raise ValueError(f"Input {value.name!r} is also a graph output; it cannot become uint8.")
    return value


def _uint8_input(original: onnx.ValueInfoProto, norm: Normalization) -> onnx.ValueInfoProto:
    """uint8 [batch as declared, H, W, 3] under the original's name."""
    from onnx import TensorProto, helper

    dims = original.type.tensor_type.shape.dim
    height, width = (dims[2], dims[3]) if norm.layout == "NCHW" else (dims[1], dims[2])
    value = helper.make_tensor_value_info(original.name, TensorProto.UINT8, None)
    shape = value.type.tensor_type.shape
    shape.dim.add().CopyFrom(dims[0])  # dim_param, dim_value or unknown: as it was
    for size in (height.dim_value, width.dim_value, 3):
        shape.dim.add().dim_value = size
    return value


def _replace_input(
    graph: onnx.GraphProto, original: onnx.ValueInfoProto, new: onnx.ValueInfoProto
) -> None:
    for index, value in enumerate(graph.input):
        if value.name == original.name:
            graph.input[index].CopyFrom(new)
            return


def _check_opset(model: onnx.ModelProto) -> None:
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions or max(versions) < _MIN_OPSET:
        raise ValueError(
            f"The model imports ONNX opset {max(versions, default=0)}; a uint8 input needs "
            f"opset {_MIN_OPSET} or later."
        )


# --- the graph ----------------------------------------------------------------------------


def _normalize_nodes(
    source: str,
    target: str,
    norm: Normalization,
    elem_type: int,
    graph: onnx.GraphProto,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes from the uint8 input `source` to the model's input tensor `target`, and the
    constants they read."""
    from onnx import TensorProto, numpy_helper

    fresh = _Names(graph, source)
    gain, shift = norm.gain_shift()  # in the model's channel order, after the flip
    weights = [
        numpy_helper.from_array(gain.astype(np.float32), fresh("gain")),
        numpy_helper.from_array(shift.astype(np.float32), fresh("shift")),
    ]
    steps: list[Step] = [("Cast", {"to": TensorProto.FLOAT}, [])]
    if norm.channel_order == "BGR":  # RGB pixels → BGR channels: reverse the last axis
        order = numpy_helper.from_array(np.array([2, 1, 0], dtype=np.int64), fresh("bgr"))
        weights.append(order)
        steps.append(("Gather", {"axis": 3}, [order.name]))
    steps += [("Mul", {}, [weights[0].name]), ("Add", {}, [weights[1].name])]
    if norm.layout == "NCHW":
        steps.append(("Transpose", {"perm": [0, 3, 1, 2]}, []))
    if elem_type == TensorProto.FLOAT16:
        steps.append(("Cast", {"to": TensorProto.FLOAT16}, []))
    return _chain(steps, source, target, fresh), weights


def _chain(
    steps: list[Step],
    source: str,
    target: str,
    fresh: _Names,
) -> list[onnx.NodeProto]:
    """One node per step, each reading the previous one's output; the last writes `target`."""
    from onnx import helper

    nodes = []
    current = source
    for index, (op, attributes, extra) in enumerate(steps):
        output = target if index == len(steps) - 1 else fresh(op.lower())
        name = fresh(f"{op.lower()}_node")
        nodes.append(helper.make_node(op, [current, *extra], [output], name=name, **attributes))
        current = output
    return nodes


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node reading `old` reads `new`, in subgraphs too unless they shadow `old`."""
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name == old:
                node.input[index] = new
        for sub in _subgraphs(node):
            if not _declares(sub, old):
                _rename_uses(sub, old, new)


def _declares(graph: onnx.GraphProto, name: str) -> bool:
    """`name` is defined inside `graph` (an input, weight or node output): it shadows ours."""
    defined = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    return name in defined or any(name in node.output for node in graph.node)


class _Names:
    """Tensor and node names not used anywhere in the graph, prefixed by the input's name."""

    def __init__(self, graph: onnx.GraphProto, prefix: str) -> None:
        self._taken = _all_names(graph)
        self._prefix = prefix

    def __call__(self, role: str) -> str:
        name = _first_free(f"{self._prefix}__uint8_{role}", self._taken)
        self._taken.add(name)
        return name


def _unused_name(graph: onnx.GraphProto, wanted: str) -> str:
    return _first_free(wanted, _all_names(graph))


def _first_free(wanted: str, taken: set[str]) -> str:
    name, count = wanted, 1
    while name in taken:
        name, count = f"{wanted}_{count}", count + 1
    return name


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
    names |= {i.name for i in graph.initializer}
    for node in graph.node:
        names |= {node.name, *node.input, *node.output}
        for sub in _subgraphs(node):
            names |= _all_names(sub)
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The bodies of If, Loop and Scan nodes."""
    found = []
    for attribute in node.attribute:
        if attribute.HasField("g"):
            found.append(attribute.g)
        found.extend(attribute.graphs)
    return found


# --- files --------------------------------------------------------------------------------


def _describe(norm: Normalization) -> str:
    return json.dumps({"scheme": SCHEME, **asdict(norm)}, sort_keys=True)


def _write_atomically(model: onnx.ModelProto, target: Path) -> None:
    """Write to a private `.part` file and rename it: concurrent workers each write their own,
    and a reader never sees half a model."""
    import onnx

    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part")
    try:
        onnx.save(model, str(part))
        part.replace(target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
