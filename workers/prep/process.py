"""A prep process: fetch, hash, check and decode a unit of items into the engine's slots.

No CUDA here, ever: these processes are started with `spawn` and import neither torch nor an
engine. Each unit's answer is columns (`Prepped`); per item Python is what decoding needs and
nothing more. A bad input fails its own item with a sentence; a storage fault worth a retry
fails the unit as transient (the chunk retries with backoff, as before).
"""

from __future__ import annotations

import logging
import os
import signal
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kiln.app.core.errors import TransientError
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.handlers import Item, handle
from kiln.workers.prep.held import HeldBytes
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.slots import Segment, SlotLayout, attach
from kiln.workers.prep.spec import Prep, PrepSpec, build
from kiln.workers.prep.units import Prepped, Unit
from kiln.workers.prep.video import VideoReaders

log = logging.getLogger(__name__)

PREP_NICE = 5
PARENT_CHECK_S = 1.0  # how often an idle prep process checks that its parent lives


class PrepWorker:
    """A prep process's state, kept between units: its fetcher, video readers, bytes held from
    read-only units, the preps it built and the slot segments it attached. Each item of a unit
    goes to the handler of its kind (workers/prep/handlers.py)."""

    def __init__(
        self, settings: PrepSettings, fetcher: Fetcher | None = None, decoder_threads: int = 0
    ) -> None:
        """`decoder_threads`: a video decoder's (0: FFmpeg's pick, about one per core)."""
        self.settings = settings
        self._fetcher = fetcher
        self._preps: dict[str, Prep] = {}
        self._segments: dict[str, Segment] = {}
        self.held = HeldBytes()
        self.videos = VideoReaders(threads=decoder_threads)

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:  # built on first use: a text model's process never needs it
            from kiln.app.storage import open_store

            self._fetcher = Fetcher(self.settings, open_store(self.settings))
        return self._fetcher

    def run(self, unit: Unit) -> Prepped:
        for item in unit.drop:
            self.held.forget(item)
        out = _blank(unit)
        try:
            slots = self._slots(unit)
            prep = None if unit.read_only else self._prep(unit.spec)
            for i in range(len(unit)):
                slot = None if slots is None or unit.slots is None else slots[int(unit.slots[i])]
                handle(self, Item(unit, i, out, prep, slot))
        except TransientError as error:
            out.transient = str(error)
        except Exception as error:  # outside one input (its model's prep would not build):
            log.exception("a prep unit failed")  # its items fail with the reason, we live on
            sentence = f"Kiln could not prepare this input: {error}."
            out.errors = [e or sentence for e in out.errors]
        return out

    def _prep(self, spec: PrepSpec) -> Prep:
        prep = self._preps.get(spec.key)
        if prep is None:
            prep = self._preps[spec.key] = build(spec)
        return prep

    def _slots(self, unit: Unit) -> np.ndarray | None:
        """The engine process's segment of slots, pixels or bytes (a slot is written through a
        view of it). One per model: a model loaded again has a new segment, and the old mapping
        is let go (an unlinked segment's memory lives as long as someone maps it)."""
        self._let_go_of_unlinked()
        layout = unit.spec.layout or (SlotLayout((unit.slot_bytes,)) if unit.slot_bytes else None)
        if unit.read_only or unit.segment is None or layout is None:
            return None
        segment = self._segments.get(unit.spec.key)
        if segment is None or segment.name != unit.segment:
            if segment is not None:
                segment.close()
            segment = attach(unit.segment, layout, unit.segment_slots)
            self._segments[unit.spec.key] = segment
        return segment.array

    def _let_go_of_unlinked(self) -> None:
        """Unmap the segments of models the worker unloaded (their files are gone): an
        unlinked segment lives as long as anyone maps it."""
        for key, segment in list(self._segments.items()):
            if not segment.path.exists():
                segment.close()
                del self._segments[key]

    def idle(self) -> None:
        """Nothing came for a while: unmap the slots of models the worker unloaded meanwhile,
        so their shared memory goes now rather than with the next unit."""
        self._let_go_of_unlinked()

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
        self.videos.close()


def _blank(unit: Unit) -> Prepped:
    """The unit's answer before its items are handled: no errors, no hashes, zeros."""
    n = len(unit)
    out = Prepped(unit.id, [None] * n, [None] * n)
    out.seconds = np.zeros((n, 2), dtype=np.float32)
    if not unit.read_only:
        out.meta = np.zeros((n, unit.spec.meta_width), dtype=np.float32)
        out.objects = None if unit.spec.layout is not None else [None] * n
    return out


def serve(conn: Connection, settings: PrepSettings, parent: int, decoder_threads: int = 0) -> None:
    """A prep process's life: units in, answers out, until told to stop or orphaned."""
    # Ctrl-C and a SIGTERM to the group reach us too: the worker decides when its prep
    # processes stop (after its in-flight chunks have drained), or we notice it is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Decoding is throughput work: under contention the engine-owning process (which feeds the
    # accelerator and answers interactive rows) and a co-located API go first; an idle core is
    # still all ours.
    os.nice(PREP_NICE)
    worker = PrepWorker(settings, decoder_threads=decoder_threads)
    try:
        while True:
            if not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    return  # the worker died without telling us
                worker.idle()
                continue
            unit: Any = conn.recv()
            if unit is None:
                return
            conn.send(worker.run(unit))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return
    finally:
        worker.close()
