"""What a prep process runs for one model: a `PrepSpec` (small, picklable: it crosses into the
prep processes) names a factory and its options; `build` makes the `Prep` inside the process.

A family's prep half lives in `workers/prep/<family>.py`; its batch half (engine and
post-processing) in `workers/models/`. A spec names its factory as `module:callable`, so a
test can run a prep of its own through the real pool.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from kiln.app.core.digest import sha256_hex
from kiln.workers.prep.slots import SlotLayout

if TYPE_CHECKING:
    from kiln.workers.prep.pixels import Decoded


class Prep(Protocol):
    """One model's input preparation, made once per prep process."""

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        """Check and decode one input. A slot family writes the pixels into `slot` (and its
        fit, e.g. a letterbox's scale and size, into `meta`) and returns None; an object family
        (`slot` is None) returns what its engine needs (picklable). Bad input raises
        `InputError` with a sentence. A family with `byte_slots` is given its row's byte slot
        as `slot` (None on the read-only pass)."""
        ...


@runtime_checkable
class FramePrep(Prep, Protocol):
    """A prep that also takes video frames, decoded already (the image families)."""

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        """The least size a frame of this size may be reduced to before the fit."""
        ...

    def prepare_decoded(self, decoded: Decoded, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        """As `prepare`, from an image already decoded."""
        ...


@runtime_checkable
class FrameModePrep(FramePrep, Protocol):
    """A frame prep that names the mode it reads frames in: "L" when all it reads of a frame
    is its grey (the decoder's luma is taken as it is, no RGB made). A frame prep that does not
    say reads "RGB"."""

    frame_mode: str


@dataclass(frozen=True)
class PrepSpec:
    key: str  # names the built `Prep` in a prep process (the model's cache key)
    factory: str  # "module:callable", called with **options
    options: Mapping[str, Any] = field(default_factory=dict)
    layout: SlotLayout | None = None  # rows go into slots of this shape; None: as objects
    meta_width: int = 0  # float32 values of fit metadata per row
    # Rows are objects whose encoded bytes go in shared byte slots (`ByteSlots`): the prep
    # writes a row's file into its slot and returns its length first (`units.in_place`).
    byte_slots: bool = False


def prep_spec(
    factory: str,
    options: Mapping[str, Any],
    layout: SlotLayout | None = None,
    meta_width: int = 0,
    byte_slots: bool = False,
) -> PrepSpec:
    """A spec keyed by what it builds: prep processes build it once and reuse it."""
    made = (factory, sorted(options.items()), layout, meta_width, byte_slots)
    return PrepSpec(sha256_hex(repr(made))[:16], factory, dict(options), layout, meta_width,
                    byte_slots)  # fmt: skip


def build(spec: PrepSpec) -> Prep:
    module, _, name = spec.factory.partition(":")
    factory: Callable[..., Prep] = getattr(importlib.import_module(module), name)
    return factory(**spec.options)
