"""Benchmark models, made here: plain-torch ResNets (random weights, fixed seed) and a null model.

torchvision is not used: its PyPI wheels do not import beside the CPU torch build this project
pins, and the architecture is small enough to write out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto, helper

if TYPE_CHECKING:
    import torch

IR_VERSION = 10  # onnxruntime refuses the IR 14 that onnx >= 1.23 writes by default
OPSET = 17
MAX_PIXELS = 50_000_000  # Kiln's default decompression-bomb cap (KILN_MAX_IMAGE_PIXELS)


def _resnet(depth: int) -> torch.nn.Module:
    import torch
    from torch import nn

    class Basic(nn.Module):
        expansion = 1

        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.down = _down(cin, width, stride)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.down(x))

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            out = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(out)
            self.down = _down(cin, out, stride)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(self.bn1(self.conv1(x)))
            y = torch.relu(self.bn2(self.conv2(y)))
            return torch.relu(self.bn3(self.conv3(y)) + self.down(x))

    def _down(cin: int, cout: int, stride: int) -> nn.Module:
        if stride == 1 and cin == cout:
            return nn.Identity()
        return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    designs: dict[int, tuple[type[Basic | Bottleneck], tuple[int, ...]]] = {
        18: (Basic, (2, 2, 2, 2)),
        50: (Bottleneck, (3, 4, 6, 3)),
    }
    block, counts = designs[depth]
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for stage, count in enumerate(counts):
        width = 64 * 2**stage
        for i in range(count):
            layers.append(block(cin, width, 2 if stage and i == 0 else 1))
            cin = width * block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers)


def export_resnet(depth: int, path: Path) -> Path:
    """Export ResNet-`depth` (seed 0, eval mode) with a dynamic batch axis."""
    import torch

    if path.exists():
        return path
    torch.manual_seed(0)
    model = _resnet(depth).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    with torch.no_grad():
        torch.onnx.export(
            model,
            (torch.zeros(1, 3, 224, 224),),
            str(tmp),
            input_names=["images"],
            output_names=["logits"],
            dynamic_axes={"images": {0: "N"}, "logits": {0: "N"}},
            opset_version=OPSET,
            dynamo=False,
        )
    proto = onnx.load(str(tmp))
    proto.ir_version = min(proto.ir_version, IR_VERSION)
    onnx.save(proto, str(path))
    tmp.unlink()
    return path


def null_model(path: Path, size: int) -> Path:
    """Costs nothing: the mean over each image, as a one-class 'logit'."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["images"], ["logits"], axes=[2, 3], keepdims=0),
            helper.make_node("Identity", ["logits"], ["out"]),
        ],
        "null",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["N", 3, size, size])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def labels(count: int) -> list[str]:
    return [f"class_{i:04d}" for i in range(count)]


def random_batch(batch: int, size: int = 224) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((batch, 3, size, size), dtype=np.float32)


# Kiln's built-in YOLOv8n detector: a user submits it by name, so the harness neither exports
# nor registers it; the cases read its file, size and steps from Kiln's own code.
DETECTOR = "detector"
BUILTIN_MODELS = frozenset({DETECTOR})


def _detector_default(parameter: str) -> Any:
    """A default of Kiln's detector predictor (input side, thresholds): the loader passes none."""
    import inspect

    from kiln.workers.models.detect import DetectorPredictor

    return inspect.signature(DetectorPredictor).parameters[parameter].default


def detector_model() -> tuple[Path, int, list[str]]:
    """The built-in detector's ONNX file, input side and labels, as Kiln's loader finds them."""
    from kiln.workers.models import detect

    return detect.model_path(), int(_detector_default("size")), list(detect.LABELS)


def preprocessing(model: str) -> str:
    """How a case feeds `model`: "letterbox" (Kiln's detector steps) or "crop" (ImageNet)."""
    return "letterbox" if model == DETECTOR else "crop"


def detector_input(data: bytes, size: int) -> tuple[np.ndarray, Any]:
    """One image as the detector's float32 NCHW batch of one, and its fit: Kiln's own steps
    (JPEG drafted to the fitted size, letterbox, normalise), as a user of the model would
    import them."""
    from kiln.workers.prep.pixels import decode_image, letterbox, letterbox_size, normalize

    decoded = decode_image(
        data, max_pixels=MAX_PIXELS, draft_to=lambda w, h: letterbox_size(w, h, size)
    )
    pixels, fit = letterbox(decoded, size)
    return normalize(np, pixels[None]), fit


def detector_boxes(output: np.ndarray, fit: Any) -> list[dict[str, Any]]:
    """One image's raw output → labelled boxes (NMS), with the thresholds Kiln defaults to."""
    from kiln.workers.models.detect import decode_yolo

    return decode_yolo(
        output,
        fit,
        score_threshold=_detector_default("score_threshold"),
        iou_threshold=_detector_default("iou_threshold"),
    )
