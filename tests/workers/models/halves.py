"""A predictor's two halves in a test, as a worker drives them: its prep (what a prep process
runs) writes one input into a slot and a meta row, or returns the object its engine takes; a
`Batch` is those rows stacked (as `runners.gather` stacks a batch's rows); `outputs` runs
both halves over inputs with `run_direct` and gives each input's outputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kiln.workers.models.base import Batch, Predictor
from kiln.workers.models.direct import answers_of
from kiln.workers.prep.spec import Prep, PrepSpec, build

_BUILT: dict[str, Prep] = {}


class Prepares(Protocol):
    """What has a prep half: a predictor, or a family's base class (ImageModelPredictor)."""

    prep: PrepSpec


def prep_of(spec: PrepSpec) -> Prep:
    """The spec's prep, built once per test process (as once per prep process)."""
    prep = _BUILT.get(spec.key)
    if prep is None:
        prep = _BUILT[spec.key] = build(spec)
    return prep


@dataclass
class Row:
    """One prepared input: its slot (slot families), its meta row, and what prep returned
    (the object of an object family)."""

    slot: np.ndarray | None
    meta: np.ndarray
    made: Any


def prepare(predictor: Prepares, data: bytes | str) -> Row:
    """One input through the predictor's prep; a bad input raises its `InputError`."""
    spec = predictor.prep
    layout = spec.layout
    slot = None if layout is None else np.zeros(layout.shape, layout.dtype)
    meta = np.zeros(spec.meta_width, dtype=np.float32)
    made = prep_of(spec).prepare(data, slot, meta)
    return Row(slot, meta, made)


def batch_of(rows: Sequence[Row]) -> Batch:
    """Prepared rows as the batch a runner gives `infer`: pixels and meta stacked, or the
    objects in order."""
    slotted = rows[0].slot is not None
    return Batch(
        np.stack([r.slot for r in rows]) if slotted else None,  # type: ignore[misc]
        np.stack([r.meta for r in rows]),
        None if slotted else [r.made for r in rows],
    )


def batch(predictor: Prepares, inputs: Sequence[bytes | str]) -> Batch:
    return batch_of([prepare(predictor, data) for data in inputs])


def outputs(
    predictor: Predictor, inputs: Sequence[bytes | str], batch: int | None = None
) -> list[dict[str, Any]]:
    """Each input's outputs (JSON values, as `run_direct` gives them); an input that failed
    (a bad input, a refusal) raises its error."""
    return answers_of(predictor, inputs, batch)
