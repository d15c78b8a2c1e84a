"""A model's batch from the blocks it was cut from: what its Batcher hands the predictor."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kiln.workers.batching.blocks import Part
from kiln.workers.models.base import Batch, Rows
from kiln.workers.prep.slots import SlotPool

# (batch shape) -> where to gather its pixels, or None: anywhere (ImageModelPredictor.pixel_buffer)
PixelBuffer = Callable[[tuple[int, ...]], np.ndarray | None]


def gather(
    parts: Sequence[Part[Rows]], slots: SlotPool | None, into: PixelBuffer | None = None
) -> Batch:
    """A batch's rows from the blocks it was cut from: pixels copied out of the slots in one
    take (the slots go back when their block settles) — into `into(shape)` when it gives a
    buffer (a GPU engine's pinned staging) — meta and objects joined."""
    pixels = None
    if slots is not None:
        taken = [p.block.slots[p.start : p.stop] for p in parts if p.block.slots is not None]
        indices = np.concatenate(taken)
        out = into((len(indices), *slots.layout.shape)) if into is not None else None
        pixels = slots.gather(indices, out)
    metas = [p.block.meta[p.start : p.stop] for p in parts if p.block.meta is not None]
    objects = [o for p in parts for o in (p.block.objects or [])[p.start : p.stop]]
    return Batch(
        pixels,
        np.concatenate(metas) if metas else None,
        objects if any(p.block.objects is not None for p in parts) else None,
    )
