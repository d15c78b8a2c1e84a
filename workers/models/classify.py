"""Any registered ONNX image classifier: centre crop, mean/std, softmax top-k with labels."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared
from kiln.workers.preprocess import center_crop, decode_image, normalize, resize_side, stack

# Parquet columns this family adds, named like `finish`'s keys; known without loading a model.
FIELDS = [
    pa.field("labels", pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())])))
]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return np.asarray(exp / exp.sum(axis=-1, keepdims=True))


def top_k(probabilities: np.ndarray, labels: Sequence[str], k: int) -> list[dict[str, Any]]:
    k = max(0, min(k, probabilities.shape[-1]))
    best = np.argsort(-probabilities, kind="stable")[:k]
    return [
        {
            "label": labels[i] if i < len(labels) else str(i),
            "score": round(float(probabilities[i]), 6),
        }
        for i in best
    ]


class ClassifyPipeline:
    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads

    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        self.name = name
        self.engine = engine
        self.backend = engine.backend
        self.max_batch = engine.max_batch
        self.size = int(spec["input_size"])
        self.labels: list[str] = list(spec["labels"])
        self.mean = tuple(spec.get("mean", (0.485, 0.456, 0.406)))
        self.std = tuple(spec.get("std", (0.229, 0.224, 0.225)))
        self.k = int(spec.get("top_k", 5))
        self.max_pixels = max_pixels
        self.input_name = engine.inputs[0].name

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        # JPEGs decode straight to the smallest DCT scale that still covers the resize.
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=resize_side(self.size))
        return Prepared(center_crop(decoded, self.size))

    def _normalize(self, xp: ModuleType, batch: Any) -> Any:
        return normalize(xp, batch, mean=self.mean, std=self.std)

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        pixels = stack([r.pixels for r in rows])  # uint8: 4x less to copy to a GPU than floats
        outputs = self.engine.infer({self.input_name: pixels}, {self.input_name: self._normalize})
        logits = next(iter(outputs.values()))
        return list(softmax(logits.reshape(len(rows), -1)))

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        return {"labels": top_k(raw, self.labels, self.k)}

    def close(self) -> None:
        """Nothing beyond the engine to release."""
