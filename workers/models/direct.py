"""A predictor over some inputs in this process, with no chunk, pool or database: its prep half
on this thread, then its batch half a batch at a time. For tools that embed or classify a few
files themselves (bench/grouping.py) and for the families' tests; workers use the chunk path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError, KilnError
from kiln.workers.models.base import Answers, Batch, Predictor, Refusal
from kiln.workers.prep.spec import build

Outcome = dict[str, Any] | KilnError  # an input's outputs, or why it has none


def run_direct(
    predictor: Predictor, inputs: Sequence[bytes | str], batch: int | None = None
) -> list[Outcome]:
    """Each input's outputs (JSON values; vectors as lists) or its error, in order."""
    prep = build(predictor.prep)
    layout, width = predictor.prep.layout, predictor.prep.meta_width
    outcomes: list[Outcome | None] = [None] * len(inputs)
    ready: list[tuple[int, np.ndarray | None, np.ndarray, Any]] = []
    for i, data in enumerate(inputs):
        slot = None if layout is None else np.zeros(layout.shape, layout.dtype)
        meta = np.zeros(width, dtype=np.float32)
        try:
            made = prep.prepare(data, slot, meta)
        except KilnError as error:
            outcomes[i] = error
            continue
        ready.append((i, slot, meta, made))
    size = batch or predictor.max_batch
    for start in range(0, len(ready), size):
        group = ready[start : start + size]
        answers = predictor.finish(predictor.infer(_batch(group, layout is not None)))
        for (i, *_), outcome in zip(group, outcomes_of(answers), strict=True):
            outcomes[i] = outcome
    return [o if o is not None else InputError("No answer.") for o in outcomes]


def answers_of(
    predictor: Predictor, inputs: Sequence[bytes | str], batch: int | None = None
) -> list[dict[str, Any]]:
    """Each input's outputs, for inputs that must all have one (generated sets, tests): the
    first input without any raises its error."""
    found = []
    for outcome in run_direct(predictor, inputs, batch):
        if isinstance(outcome, Exception):
            raise outcome
        found.append(outcome)
    return found


def _batch(group: list[tuple[int, np.ndarray | None, np.ndarray, Any]], slotted: bool) -> Batch:
    return Batch(
        np.stack([slot for _, slot, _, _ in group]) if slotted else None,  # type: ignore[misc]
        np.stack([meta for _, _, meta, _ in group]),
        None if slotted else [made for *_, made in group],
    )


def outcomes_of(answers: Answers) -> list[Outcome]:
    """Answers as each row's outputs or error (a refusal stays a `Refusal`)."""
    rows = pa.table(answers.columns).to_pylist() if answers.columns else [{}] * answers.rows
    outcomes: list[Outcome] = []
    for row, error, refused in zip(rows, answers.error_list(), answers.refused_list(), strict=True):
        if error is None:
            outcomes.append(row)
        else:
            outcomes.append(Refusal(error) if refused else InputError(error))
    return outcomes
