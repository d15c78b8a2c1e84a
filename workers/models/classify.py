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
from kiln.workers.models.image_model import ImageModelPredictor

_LABEL = pa.struct([("label", pa.string()), ("score", pa.float32())])
# Parquet columns this family adds, named like its answers; known without loading a model.
FIELDS = [pa.field("labels", pa.list_(_LABEL))]
SCORE_DIGITS = 6


def softmax(logits: np.ndarray) -> np.ndarray:
    exp, total = shifted_exp(logits)
    exp /= total[:, np.newaxis] if exp.ndim > 1 else total
    return exp


def shifted_exp(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax before its division: each row's exp(logit - row max), in one new array, and
    its sums. A row's probabilities are these over its sum, in the same order (the division
    by one positive number keeps it), so the top k are chosen here and only their k scores
    divided; the top score is 1 / sum (its exp is exp(0))."""
    if not np.issubdtype(logits.dtype, np.floating):
        logits = logits.astype(np.float64)
    exp = logits - logits.max(axis=-1, keepdims=True)
    np.exp(exp, out=exp)
    return exp, exp.sum(axis=-1)


def top_k_indices(probabilities: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) class indices, best first, ties to the lower index (a stable sort's order),
    without sorting every class: `argpartition` (the k largest last: no negated copy of the
    scores), then the k sorted; a row with a tie across the k-th place (rare: equal scores)
    is sorted whole instead."""
    classes = probabilities.shape[1]
    k = max(0, min(k, classes))
    if k == 0 or k == classes:
        return np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    part = np.argpartition(probabilities, classes - k, axis=1)[:, classes - k :]
    scores = np.take_along_axis(probabilities, part, axis=1)
    order = np.lexsort((part, -scores), axis=1)  # by score, then index
    best = np.take_along_axis(part, order, axis=1)
    kth = np.take_along_axis(probabilities, best[:, -1:], axis=1)
    tied = (np.count_nonzero(probabilities == kth, axis=1) > 1).nonzero()[0]
    if len(tied):
        best[tied] = np.argsort(-probabilities[tied], axis=1, kind="stable")[:, :k]
    return best


ARGMAX_K = 16  # up to this k, the top k are taken by k argmax passes (`take_top_k`)


def take_top_k(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's top k (class indices, best first, ties to the lower index) and their
    scores, as `top_k_indices` orders them, overwriting `scores` (the caller's scratch). For
    a small k, k passes of `argmax` (the first of equal maxima: the lower index), each
    taken out with -inf: no (rows, classes) index array to allocate and partition, which
    cost ~2.5 µs a row of 1,000 classes in `kiln run`, most of the runners' own work."""
    rows, classes = scores.shape
    k = max(0, min(k, classes))
    if k > ARGMAX_K:
        best = top_k_indices(scores, k)
        return best, np.take_along_axis(scores, best, axis=1)
    every = np.arange(rows)
    best = np.empty((rows, k), dtype=np.intp)
    taken = np.empty((rows, k), dtype=scores.dtype)
    for place in range(k):
        top = scores.argmax(axis=1)
        best[:, place] = top
        taken[:, place] = scores[every, top]
        scores[every, top] = -np.inf
    return best, taken


def label_lists(
    probabilities: np.ndarray, labels: Sequence[str], k: int, refused: np.ndarray | None = None
) -> pa.Array:
    """Each row's top k as a list of {label, score} (null where `refused`), in Arrow, with no
    Arrow compute kernel (`names_of`)."""
    best = top_k_indices(probabilities, k)
    return labelled(best, np.take_along_axis(probabilities, best, axis=1), labels, refused)


def labelled(
    best: np.ndarray, scores: np.ndarray, labels: Sequence[str], refused: np.ndarray | None
) -> pa.Array:
    """Rows of (class, score) pairs, best first, as lists of {label, score}: built from
    NumPy buffers (`names_of`, `numeric`), once per batch."""
    rows, k = best.shape
    values = pa.StructArray.from_arrays(
        [
            names_of(labels, best.ravel()),
            numeric(np.round(scores.astype(np.float64), SCORE_DIGITS)),
        ],
        names=["label", "score"],
    )
    offsets = numeric(np.arange(rows + 1) * k, pa.int32())
    return pa.ListArray.from_arrays(offsets, values, mask=null_mask(refused))


def top_k(probabilities: np.ndarray, labels: Sequence[str], k: int) -> list[dict[str, Any]]:
    """One row's top k as the results show it (tests and tools: the batch path is above)."""
    return list(label_lists(probabilities[np.newaxis], labels, k)[0].as_py())


class ClassifyPredictor(ImageModelPredictor):
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
        # Softmax's division only for the k scores shown (`shifted_exp`): a pass over every
        # class less, per batch.
        exp, total = shifted_exp(logits)
        best, chosen = take_top_k(exp, self.k)  # `exp` is spent
        scores = chosen / total[:, np.newaxis]
        failed = self._unsure(1 / total) | failed  # the top score: its exp is exp(0) = 1
        refused = np.zeros(len(batch), dtype=bool)
        refused[list(failed)] = True
        columns = {"labels": labelled(best, scores, self.labels, refused)}
        if not failed:
            return Answers(len(batch), columns)
        errors, refusals = row_errors(len(batch), failed)
        return Answers(len(batch), columns, errors, refusals)

    def _unsure(self, top: np.ndarray) -> dict[int, Exception]:
        """Rows whose top score (`top`, a row's) is below the model's floor: refused, with
        the score shown."""
        if self.refuse_below is None:
            return {}
        floor = self.refuse_below
        refused: dict[int, Exception] = {}
        for i in (top < floor).nonzero()[0]:
            shown = math.floor(float(top[i]) * 10_000) / 10_000  # never shown at the floor
            refused[int(i)] = Refusal(
                f"Refused: the top score {shown:g} is below the model's floor {floor:g}."
            )
        return refused
