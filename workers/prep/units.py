"""What crosses between the engine-owning process and a prep process: a `Unit` of a chunk's
items out, their `Prepped` columns back. Pixels never travel here: they are in the slots; nor
do encoded files that fit a byte slot (`in_place` turns them back into bytes, in place)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.app.video import Sampling
from kiln.workers.prep.slots import ByteSlots
from kiln.workers.prep.spec import PrepSpec

UNIT_ROWS = 32  # items per unit at most: small enough to spread, large enough to amortise


@dataclass
class Unit:
    """Some of a chunk's items for one prep process. `read_only`: fetch and hash them and keep
    the bytes (the content cache is consulted before anything decodes); a later unit for the
    same items prepares them from those bytes."""

    id: int
    spec: PrepSpec
    items: list[int]  # item ids: what held bytes are kept under
    sources: list[str | None]  # where each item's bytes are (None for a text item)
    texts: list[str | None]
    max_bytes: int
    slots: np.ndarray | None = None  # one per item, for slot families
    segment: str | None = None  # the slot pool's shared-memory name
    segment_slots: int = 0
    slot_bytes: int = 0  # the segment's slots are `ByteSlots` of this many bytes (0: pixels)
    read_only: bool = False
    drop: list[int] = field(default_factory=list)  # held bytes no longer wanted
    # A frame item's moment in its video (seconds; None for any other item): its source is
    # the video's. `sampling`: the job's, for an item that turns out to be a video.
    frames: list[float | None] | None = None
    sampling: Sampling | None = None

    def __len__(self) -> int:
        return len(self.items)

    def only(self, index: int) -> Unit:
        """The unit of one of its items (to find an input that crashes its prep process)."""
        slots = None if self.slots is None else self.slots[index : index + 1]
        return Unit(
            self.id, self.spec, self.items[index : index + 1], self.sources[index : index + 1],
            self.texts[index : index + 1], self.max_bytes, slots, self.segment,
            self.segment_slots, slot_bytes=self.slot_bytes, read_only=self.read_only,
            frames=None if self.frames is None else self.frames[index : index + 1],
            sampling=self.sampling,
        )  # fmt: skip


@dataclass
class Prepped:
    """A unit's items, as columns in the unit's order."""

    unit: int
    errors: list[str | None]  # a sentence for each item that failed, else None
    sha256: list[str | None]  # of the bytes read (None where nothing could be read)
    meta: np.ndarray | None = None  # (items, meta_width) float32: each row's fit
    objects: list[Any] | None = None  # object families: what the engine needs per item
    seconds: np.ndarray | None = None  # (items, 2) float32: fetch, prepare
    transient: str | None = None  # a fault worth retrying the chunk for (storage throttling)
    worker: int = -1  # which prep process answered (it holds a read-only unit's bytes)
    videos: list[Any] | None = None  # per item: its `FramePlan` where it turned out a video

    def __len__(self) -> int:
        return len(self.errors)

    @staticmethod
    def join(unit: int, parts: list[Prepped]) -> Prepped:
        """One unit's answer from the answers of its items, run one by one (an item that
        stopped its process has no meta or object: zeros and None stand in)."""
        width = next((p.meta.shape[1] for p in parts if p.meta is not None), 0)
        has_objects = any(p.objects is not None for p in parts)
        return Prepped(
            unit,
            [e for p in parts for e in p.errors],
            [s for p in parts for s in p.sha256],
            np.concatenate([_meta(p, width) for p in parts]) if parts else None,
            [o for p in parts for o in (p.objects or [None] * len(p))] if has_objects else None,
            np.concatenate([_seconds(p) for p in parts]) if parts else None,
            next((p.transient for p in parts if p.transient), None),
            videos=[v for p in parts for v in (p.videos or [None] * len(p))],
        )


def _meta(part: Prepped, width: int) -> np.ndarray:
    return part.meta if part.meta is not None else np.zeros((len(part), width), np.float32)


def _seconds(part: Prepped) -> np.ndarray:
    return part.seconds if part.seconds is not None else np.zeros((len(part), 2), np.float32)


def in_place(objects: list[Any], slots: ByteSlots, tickets: np.ndarray) -> list[Any]:
    """A unit's objects as the engine reads them, for a family with byte slots: a row whose
    object begins with a length (its prep process wrote that many bytes into the row's slot)
    gets a memoryview of them in its place, valid until the row's slot is given back (when
    its block settles); a row whose bytes did not fit keeps them (they came with the answer)."""
    out = list(objects)
    for i, made in enumerate(objects):
        if type(made) is tuple and type(made[0]) is int:
            out[i] = (slots.view(int(tickets[i]), made[0]), *made[1:])
    return out
