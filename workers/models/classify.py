"""Any registered ONNX image classifier: its declared preprocessing, softmax top-k with labels,
and — when its spec declares `refuse_below` — a refusal below that confidence floor."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared, Refusal
from kiln.workers.models.image_model import ImageModelPipeline

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


class ClassifyPipeline(ImageModelPipeline):
    kind = "classify"

    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        super().__init__(name, engine, spec, max_pixels=max_pixels)
        self.labels: list[str] = list(spec["labels"])
        self.k = int(spec.get("top_k", 5))
        floor = spec.get("refuse_below")
        self.refuse_below: float | None = None if floor is None else float(floor)

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        return list(softmax(self._run(rows)))

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        self._raise_if_failed(row)
        self._refuse_if_unsure(raw)
        return {"labels": top_k(raw, self.labels, self.k)}

    def _refuse_if_unsure(self, probabilities: np.ndarray) -> None:
        top = float(np.max(probabilities))
        if self.refuse_below is not None and top < self.refuse_below:
            shown = math.floor(top * 10_000) / 10_000  # rounded down: never shown at the floor
            floor = self.refuse_below
            raise Refusal(f"Refused: the top score {shown:g} is below the model's floor {floor:g}.")
