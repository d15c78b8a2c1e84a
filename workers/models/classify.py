"""Any registered ONNX image classifier: its declared preprocessing, softmax top-k with labels,
and — when its spec declares `refuse_below` — a refusal below that confidence floor. All of it
per batch, in NumPy and Arrow: no Python per image."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.workers.engines.base import Engine
from kiln.workers.models.base import (
    Answers,
    Batch,
    Refusal,
    names_of,
    null_mask,
    numeric,
    row_errors,
)
from kiln.workers.models.image_model import ImageModelPipeline

_LABEL = pa.struct([("label", pa.string()), ("score", pa.float32())])
# Parquet columns this family adds, named like its answers; known without loading a model.
FIELDS = [pa.field("labels", pa.list_(_LABEL))]
SCORE_DIGITS = 6


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return np.asarray(exp / exp.sum(axis=-1, keepdims=True))


def top_k_indices(probabilities: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) class indices, best first, ties to the lower index (a stable sort's order),
    without sorting every class: `argpartition`, then the k sorted; a row with a tie across
    the k-th place (rare: equal scores) is sorted whole instead."""
    classes = probabilities.shape[1]
    k = max(0, min(k, classes))
    if k == 0 or k == classes:
        return np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    part = np.argpartition(-probabilities, k - 1, axis=1)[:, :k]
    scores = np.take_along_axis(probabilities, part, axis=1)
    order = np.lexsort((part, -scores), axis=1)  # by score, then index
    best = np.take_along_axis(part, order, axis=1)
    kth = np.take_along_axis(probabilities, best[:, -1:], axis=1)
    tied = ((probabilities == kth).sum(axis=1) > 1).nonzero()[0]
    if len(tied):
        best[tied] = np.argsort(-probabilities[tied], axis=1, kind="stable")[:, :k]
    return best


def label_lists(
    probabilities: np.ndarray, labels: Sequence[str], k: int, refused: np.ndarray | None = None
) -> pa.Array:
    """Each row's top k as a list of {label, score} (null where `refused`), in Arrow, with no
    Arrow compute kernel (`names_of`)."""
    rows = probabilities.shape[0]
    best = top_k_indices(probabilities, k)
    scores = np.take_along_axis(probabilities, best, axis=1).astype(np.float64)
    values = pa.StructArray.from_arrays(
        [names_of(labels, best.ravel()), numeric(np.round(scores, SCORE_DIGITS))],
        names=["label", "score"],
    )
    offsets = numeric(np.arange(0, rows * best.shape[1] + 1, best.shape[1]), pa.int32())
    return pa.ListArray.from_arrays(offsets, values, mask=null_mask(refused))


def top_k(probabilities: np.ndarray, labels: Sequence[str], k: int) -> list[dict[str, Any]]:
    """One row's top k as the results show it (tests and tools: the batch path is above)."""
    return list(label_lists(probabilities[np.newaxis], labels, k)[0].as_py())


class ClassifyPipeline(ImageModelPipeline):
    kind = "classify"

    def __init__(
        self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int, **kw: Any
    ) -> None:
        super().__init__(name, engine, spec, max_pixels=max_pixels, **kw)
        self.labels: list[str] = list(spec["labels"])
        self.k = int(spec.get("top_k", 5))
        floor = spec.get("refuse_below")
        self.refuse_below: float | None = None if floor is None else float(floor)

    def infer(self, batch: Batch) -> Answers:
        logits, failed = self._run(batch)
        probabilities = softmax(logits)
        failed = self._unsure(probabilities) | failed  # a row that did not decode says so
        refused = np.zeros(len(batch), dtype=bool)
        refused[list(failed)] = True
        columns = {"labels": label_lists(probabilities, self.labels, self.k, refused)}
        if not failed:
            return Answers(len(batch), columns)
        errors, refusals = row_errors(len(batch), failed)
        return Answers(len(batch), columns, errors, refusals)

    def _unsure(self, probabilities: np.ndarray) -> dict[int, Exception]:
        """Rows whose top score is below the model's floor: refused, with the score shown."""
        if self.refuse_below is None:
            return {}
        top = probabilities.max(axis=1)
        floor = self.refuse_below
        refused: dict[int, Exception] = {}
        for i in (top < floor).nonzero()[0]:
            shown = math.floor(float(top[i]) * 10_000) / 10_000  # never shown at the floor
            refused[int(i)] = Refusal(
                f"Refused: the top score {shown:g} is below the model's floor {floor:g}."
            )
        return refused
