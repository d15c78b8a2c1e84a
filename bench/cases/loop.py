"""Decode + engine loop: what a plain script does — read, decode, resize, infer, one by one."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from bench.measure import Meter
from bench.models import detector_boxes, detector_input, preprocessing
from bench.results import CaseResult

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def preprocess(source: Path | IO[bytes], size: int) -> np.ndarray:
    image = Image.open(source).convert("RGB")
    scale = round(size / 0.875) / min(image.size)
    image = image.resize(
        (round(image.width * scale), round(image.height * scale)), Image.Resampling.BILINEAR
    )
    left, top = (image.width - size) // 2, (image.height - size) // 2
    image = image.crop((left, top, left + size, top + size))
    x = (np.asarray(image, dtype=np.float32) / 255 - MEAN) / STD
    return x.transpose(2, 0, 1)[None]


def prepare(kind: str, source: Path | bytes, size: int) -> tuple[np.ndarray, Any]:
    """One image as a batch of one, and what `finish` needs. `kind` (bench.models.preprocessing):
    "crop", the plain Pillow path above; "letterbox", Kiln's own steps for its detector."""
    if kind == "letterbox":
        data = source.read_bytes() if isinstance(source, Path) else source
        return detector_input(data, size)
    return preprocess(source if isinstance(source, Path) else io.BytesIO(source), size), None


def finish(kind: str, output: np.ndarray, meta: Any) -> Any:
    """One image's output row → its answer: boxes after NMS, or the top-5 classes."""
    if kind == "letterbox":
        return detector_boxes(output, meta)
    return np.argsort(-output)[:5]


def measure(args: dict[str, Any]) -> CaseResult:
    files = [Path(f) for f in args["files"]]
    size, kind = int(args["size"]), str(args.get("preprocess", "crop"))
    sess = ort.InferenceSession(args["onnx"], providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    with Meter({"subject": [os.getpid()]}).window() as usage:
        for path in files:
            x, meta = prepare(kind, path, size)
            finish(kind, sess.run(None, {name: x})[0][0], meta)
    return CaseResult.from_usage("loop", args["model"], len(files), usage)


def run(ctx: Any, model: str) -> CaseResult:
    from bench.child import run_child

    info = ctx.models[model]
    args = {
        "model": model,
        "onnx": str(info.onnx),
        "size": info.input_size,
        "files": [str(p) for p in ctx.images],
        "preprocess": preprocessing(model),
    }
    return run_child("loop", args, ctx.log_dir)
