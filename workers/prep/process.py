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
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import InputError, KilnError, TransientError
from kiln.app.sources import IMAGE_SUFFIXES
from kiln.app.video import DEFAULT_FPS, HEAD_BYTES, Sampling, VideoLimits, container_of
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.slots import Segment, attach
from kiln.workers.prep.spec import FramePrep, Prep, PrepSpec, build
from kiln.workers.prep.units import Prepped, Unit
from kiln.workers.prep.video import VideoReaders, decoded_frame, plan

log = logging.getLogger(__name__)

HELD_BYTES = 128 * 2**20  # bytes of read-only units kept for their prepare, at most
PREP_NICE = 5
PARENT_CHECK_S = 1.0  # how often an idle prep process checks that its parent lives


class PrepWorker:
    """Runs units; keeps what it built (preps, attached segments) between them."""

    def __init__(
        self, settings: Settings, fetcher: Fetcher | None = None, decoder_threads: int = 0
    ) -> None:
        """`decoder_threads`: a video decoder's (0: FFmpeg's pick, about one per core)."""
        self.settings = settings
        self._fetcher = fetcher
        self._preps: dict[str, Prep] = {}
        self._segments: dict[str, Segment] = {}
        self._held: OrderedDict[int, bytes] = OrderedDict()  # item id → bytes (read-only units)
        self._held_bytes = 0
        self.videos = VideoReaders(threads=decoder_threads)

    @property
    def fetcher(self) -> Fetcher:
        if self._fetcher is None:  # built on first use: a text model's process never needs it
            from kiln.app.storage import open_store

            self._fetcher = Fetcher(self.settings, open_store(self.settings))
        return self._fetcher

    def run(self, unit: Unit) -> Prepped:
        for item in unit.drop:
            self._forget(item)
        n = len(unit)
        out = Prepped(unit.id, [None] * n, [None] * n)
        out.seconds = np.zeros((n, 2), dtype=np.float32)
        if not unit.read_only:
            out.meta = np.zeros((n, unit.spec.meta_width), dtype=np.float32)
            out.objects = None if unit.spec.layout is not None else [None] * n
        try:
            self._run(unit, out)
        except TransientError as error:
            out.transient = str(error)
        except Exception as error:  # outside one input (its model's prep would not build):
            log.exception("a prep unit failed")  # its items fail with the reason, we live on
            sentence = f"Kiln could not prepare this input: {error}."
            out.errors = [e or sentence for e in out.errors]
        return out

    def _run(self, unit: Unit, out: Prepped) -> None:
        slots = self._slots(unit)
        prep = None if unit.read_only else self._prep(unit.spec)
        assert out.seconds is not None
        for i in range(len(unit)):
            started = time.perf_counter()
            frame = unit.frames[i] if unit.frames is not None else None
            if frame is not None:  # one moment of a video: decoded by this process's reader
                if not unit.read_only:
                    self._frame(unit, i, frame, prep, slots, out)
                out.seconds[i, 1] = time.perf_counter() - started
                continue
            data = self._data(unit, i, out)
            fetched = time.perf_counter()
            out.seconds[i, 0] = fetched - started
            if data is None:
                continue
            if isinstance(data, Path) or (isinstance(data, bytes) and is_video(data)):
                self._video_item(unit, i, data, out)
            elif unit.read_only:
                if isinstance(data, bytes):  # a text is in the unit already
                    self._hold(unit.items[i], data)
            else:
                assert prep is not None
                self._prepare(unit, i, data, prep, slots, out)
            out.seconds[i, 1] = time.perf_counter() - fetched

    def _prepare(
        self,
        unit: Unit,
        i: int,
        data: bytes | str,
        prep: Prep,
        slots: np.ndarray | None,
        out: Prepped,
    ) -> None:
        assert out.meta is not None
        slot = None if slots is None or unit.slots is None else slots[int(unit.slots[i])]
        try:
            made = prep.prepare(data, slot, out.meta[i])
        except KilnError as error:
            out.errors[i] = str(error)
        except Exception as error:  # a decoder bug fails one item, never the unit
            log.warning("preparing item %d failed: %r", unit.items[i], error)
            out.errors[i] = f"The input could not be prepared: {error}."
        else:
            if out.objects is not None:
                out.objects[i] = made

    def _video_item(self, unit: Unit, i: int, data: bytes | Path, out: Prepped) -> None:
        """A video: planned, never prepared as one input; fetched bytes are kept for the units
        of its frames."""
        if isinstance(data, bytes) and unit.sources[i]:
            self.videos.hold(unit.sources[i] or "", data)
        if not unit.read_only:
            self._plan(unit, i, data, out)

    def _plan(self, unit: Unit, i: int, data: bytes | Path, out: Prepped) -> None:
        """The item is a video: which frames the job samples from it (or why none)."""
        sampling = unit.sampling or Sampling(DEFAULT_FPS, self._limits())
        try:
            made = plan(data, sampling.fps, sampling.limits)
        except KilnError as error:
            out.errors[i] = str(error)
            return
        except Exception as error:  # FFmpeg's surprises fail the video, never the unit
            log.warning("planning video item %d failed: %r", unit.items[i], error)
            out.errors[i] = f"The video could not be read: {error}."
            return
        if out.videos is None:
            out.videos = [None] * len(unit)
        out.videos[i] = made

    def _frame(
        self,
        unit: Unit,
        i: int,
        time_s: float,
        prep: Prep | None,
        slots: np.ndarray | None,
        out: Prepped,
    ) -> None:
        """One sampled frame, decoded by the reader that is nearest it, into its slot."""
        assert prep is not None and out.meta is not None
        source = unit.sources[i] or ""
        slot = None if slots is None or unit.slots is None else slots[int(unit.slots[i])]
        try:
            if not isinstance(prep, FramePrep):
                raise InputError("This model takes text, not video frames.")
            reader = self.videos.reader(source, time_s, self._video(source, unit.max_bytes))
            fps = unit.sampling.fps if unit.sampling is not None else DEFAULT_FPS
            frame = reader.frame(time_s, fps)
            want = prep.frame_size(frame.width, frame.height)
            decoded = decoded_frame(frame, want, getattr(prep, "frame_mode", "RGB"))
            made = prep.prepare_decoded(decoded, slot, out.meta[i])
        except TransientError:
            raise
        except KilnError as error:
            out.errors[i] = str(error)
        except Exception as error:  # a decoder bug fails one frame, never the unit
            log.warning("frame %.3f s of item %d failed: %r", time_s, unit.items[i], error)
            out.errors[i] = f"The frame at {time_s:.3f} s could not be prepared: {error}."
        else:
            if out.objects is not None:
                out.objects[i] = made

    def _video(self, source: str, max_bytes: int) -> bytes | Path:
        """Where a video's bytes are for a reader: its file (kiln run), else fetched once and
        kept for the units after."""
        path = self.fetcher.local_path(source)
        if path is not None:
            if not path.is_file():
                raise InputError(f"There is no file at {path}.")
            return path
        data = self.videos.held(source)
        if data is None:
            data = self.fetcher.fetch(source, max_bytes)
            self.videos.hold(source, data)
        return data

    def _limits(self) -> VideoLimits:
        return VideoLimits(self.settings.max_video_frames, self.settings.max_video_duration_s)

    def _data(self, unit: Unit, i: int, out: Prepped) -> bytes | str | Path | None:
        """The item's text, or its bytes (held from a read-only unit, or fetched); hashed. A
        local video is not read here: its path comes back (readers open it where it is)."""
        text = unit.texts[i]
        if text is not None:
            out.sha256[i] = sha256_hex(text)
            return text
        path = self.fetcher.local_path(unit.sources[i])
        if path is not None and _local_video(path):
            return path
        data = self._held.pop(unit.items[i], None)
        if data is not None:
            self._held_bytes -= len(data)
        else:
            try:
                data = self.fetcher.fetch(unit.sources[i], unit.max_bytes)
            except TransientError:
                raise  # the whole unit, and so the chunk, is retried
            except KilnError as error:
                out.errors[i] = str(error)
                return None
        out.sha256[i] = sha256_hex(data)
        return data

    def _hold(self, item: int, data: bytes) -> None:
        self._forget(item)
        self._held[item] = data
        self._held_bytes += len(data)
        while self._held_bytes > HELD_BYTES and len(self._held) > 1:
            _, old = self._held.popitem(last=False)  # its prepare will fetch it again
            self._held_bytes -= len(old)

    def _forget(self, item: int) -> None:
        data = self._held.pop(item, None)
        if data is not None:
            self._held_bytes -= len(data)

    def _prep(self, spec: PrepSpec) -> Prep:
        prep = self._preps.get(spec.key)
        if prep is None:
            prep = self._preps[spec.key] = build(spec)
        return prep

    def _slots(self, unit: Unit) -> np.ndarray | None:
        """The engine process's segment of slots (a slot is written through a view of it). One
        per model: a model loaded again has a new segment, and the old mapping is let go (an
        unlinked segment's memory lives as long as someone maps it)."""
        self._let_go_of_unlinked()
        if unit.read_only or unit.segment is None or unit.spec.layout is None:
            return None
        segment = self._segments.get(unit.spec.key)
        if segment is None or segment.name != unit.segment:
            if segment is not None:
                segment.close()
            segment = attach(unit.segment, unit.spec.layout, unit.segment_slots)
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


def is_video(data: bytes) -> bool:
    return container_of(data[:HEAD_BYTES]) is not None


def _local_video(path: Path) -> bool:
    """Whether a local file begins as a video does (a missing file, or one that is not a
    regular file — a FIFO, whose bytes a peek would take — is left to the fetch). A file named
    as an image is not opened twice to be sure: a video so named is read whole, then known by
    its bytes all the same."""
    if path.suffix.lower() in IMAGE_SUFFIXES or not path.is_file():
        return False
    try:
        with path.open("rb") as file:
            return container_of(file.read(HEAD_BYTES)) is not None
    except OSError:
        return False


def serve(conn: Connection, settings: Settings, parent: int, decoder_threads: int = 0) -> None:
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
