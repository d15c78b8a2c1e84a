"""One handler per kind of item a prep process is sent, and the plain dispatch between them.

An item is read first — a text is in the unit; bytes are held from a read-only unit or fetched;
a local video is not read, its path comes back — then goes to the first handler in `KINDS` whose
test holds: a frame (one moment of a video, read by its own handler), a video (planned, never
prepared whole), an item of a read-only unit (its bytes kept), else an image or a text (prepared
by the model's prep). A handler writes the item's row of the unit's answer: a bad input fails
its own item with a sentence; a storage fault worth a retry (`TransientError`) leaves the unit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import InputError, KilnError, TransientError
from kiln.app.sources import IMAGE_SUFFIXES
from kiln.app.video import DEFAULT_FPS, HEAD_BYTES, Sampling, VideoLimits, container_of
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.held import HeldBytes
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.spec import FrameModePrep, FramePrep, Prep
from kiln.workers.prep.units import Prepped, Unit
from kiln.workers.prep.video import VideoReaders, decoded_frame, plan

log = logging.getLogger(__name__)

Data = bytes | str | Path | None  # what reading an item gave (None: a frame, read later)


class Process(Protocol):
    """What handlers use of their prep process's state (`PrepWorker`), kept between units."""

    settings: PrepSettings
    videos: VideoReaders  # open readers and fetched videos' bytes
    held: HeldBytes  # bytes of read-only units' items

    @property
    def fetcher(self) -> Fetcher: ...


@dataclass
class Item:
    """One item of a unit in hand: the unit and the item's place in it, the unit's answer (the
    handler writes the item's row), the model's prep (None for a read-only unit) and the
    item's slot (None for object families and read-only units). `held`: its bytes were kept
    from its read-only unit, which hashed them and found no video in them (a video's bytes
    are never held), so neither is done again."""

    unit: Unit
    i: int
    out: Prepped
    prep: Prep | None
    slot: np.ndarray | None
    held: bool = False

    @property
    def id(self) -> int:
        return self.unit.items[self.i]

    @property
    def source(self) -> str:
        return self.unit.sources[self.i] or ""

    @property
    def frame(self) -> float | None:
        """A frame item's moment in its video (seconds); None for any other item."""
        return None if self.unit.frames is None else self.unit.frames[self.i]

    def fail(self, sentence: str) -> None:
        self.out.errors[self.i] = sentence

    def made(self, made: Any) -> None:
        """What an object family's prep returned for the item (a slot family's is None)."""
        if self.out.objects is not None:
            self.out.objects[self.i] = made


Handler = Callable[[Process, Item, Data], None]


def handle(process: Process, item: Item) -> None:
    """Read the item, then hand it to its kind's handler; its seconds are the fetch and the
    rest (a frame's are all the rest: its handler reads it)."""
    assert item.out.seconds is not None
    started = time.perf_counter()
    data: Data = None
    if item.frame is None:
        data = read(process, item)
        fetched = time.perf_counter()
        item.out.seconds[item.i, 0] = fetched - started
        if data is None:
            return
        started = fetched
    handler = next(handler for test, handler in KINDS if test(item, data))
    handler(process, item, data)
    item.out.seconds[item.i, 1] = time.perf_counter() - started


def read(process: Process, item: Item) -> Data:
    """The item's text, or its bytes (held from a read-only unit, with the hash taken then, or
    fetched and hashed). A local video is not read here: its path comes back (readers open it
    where it is); held bytes are never a video's. None: nothing could be read (the item has
    failed with why)."""
    text = item.unit.texts[item.i]
    if text is not None:
        item.out.sha256[item.i] = sha256_hex(text)
        return text
    held = process.held.take(item.id)
    if held is not None:
        item.held = True
        item.out.sha256[item.i] = held.sha256
        return held.data
    path = process.fetcher.local_path(item.unit.sources[item.i])
    if path is not None and _local_video(path):
        return path
    try:
        data = process.fetcher.fetch(item.unit.sources[item.i], item.unit.max_bytes)
    except TransientError:
        raise  # the whole unit, and so the chunk, is retried
    except KilnError as error:
        item.fail(str(error))
        return None
    item.out.sha256[item.i] = sha256_hex(data)
    return data


# --- the kinds ------------------------------------------------------------------------------


def frame(process: Process, item: Item, data: Data) -> None:
    """One sampled moment of a video, decoded by the reader nearest it, into its slot. A
    read-only unit reads nothing of it (the content cache knows no frame before it decodes)."""
    prep, time_s = item.prep, item.frame
    if prep is None:
        return
    assert time_s is not None and item.out.meta is not None
    try:
        if not isinstance(prep, FramePrep):
            raise InputError("This model takes text, not video frames.")
        source = item.source
        reader = process.videos.reader(source, time_s, _video(process, source, item.unit))
        fps = item.unit.sampling.fps if item.unit.sampling is not None else DEFAULT_FPS
        raw = reader.frame(time_s, fps)
        want = prep.frame_size(raw.width, raw.height)
        mode = prep.frame_mode if isinstance(prep, FrameModePrep) else "RGB"
        decoded = decoded_frame(raw, want, mode)
        made = prep.prepare_decoded(decoded, item.slot, item.out.meta[item.i])
    except TransientError:
        raise
    except KilnError as error:
        item.fail(str(error))
    except Exception as error:  # a decoder bug fails one frame, never the unit
        log.warning("frame %.3f s of item %d failed: %r", time_s, item.id, error)
        item.fail(f"The frame at {time_s:.3f} s could not be prepared: {error}.")
    else:
        item.made(made)


def video(process: Process, item: Item, data: Data) -> None:
    """A video: which frames the job samples from it (or why none); never prepared as one
    input. Fetched bytes are kept for the units of its frames."""
    assert isinstance(data, bytes | Path)
    if isinstance(data, bytes) and item.source:
        process.videos.hold(item.source, data)
    if item.unit.read_only:
        return
    sampling = item.unit.sampling or Sampling(DEFAULT_FPS, _limits(process.settings))
    try:
        made = plan(data, sampling.fps, sampling.limits)
    except KilnError as error:
        item.fail(str(error))
        return
    except Exception as error:  # FFmpeg's surprises fail the video, never the unit
        log.warning("planning video item %d failed: %r", item.id, error)
        item.fail(f"The video could not be read: {error}.")
        return
    if item.out.videos is None:
        item.out.videos = [None] * len(item.unit)
    item.out.videos[item.i] = made


def hold(process: Process, item: Item, data: Data) -> None:
    """An item of a read-only unit: its bytes are kept for the unit that prepares it (a text
    is in that unit already)."""
    digest = item.out.sha256[item.i]
    if isinstance(data, bytes) and digest is not None:
        process.held.hold(item.id, data, digest)


def prepare(process: Process, item: Item, data: Data) -> None:
    """An image or a text, checked and decoded by the model's prep."""
    assert item.prep is not None and item.out.meta is not None
    assert isinstance(data, bytes | str)
    try:
        made = item.prep.prepare(data, item.slot, item.out.meta[item.i])
    except KilnError as error:
        item.fail(str(error))
    except Exception as error:  # a decoder bug fails one item, never the unit
        log.warning("preparing item %d failed: %r", item.id, error)
        item.fail(f"The input could not be prepared: {error}.")
    else:
        item.made(made)


def _is_frame(item: Item, data: Data) -> bool:
    return item.frame is not None


def _is_video(item: Item, data: Data) -> bool:
    if item.held:
        return False  # its read-only unit looked: a video is not held
    return isinstance(data, Path) or (isinstance(data, bytes) and is_video(data))


def _read_only(item: Item, data: Data) -> bool:
    return item.unit.read_only


def _anything(item: Item, data: Data) -> bool:
    return True


# In order: the first kind whose test holds handles the item.
KINDS: list[tuple[Callable[[Item, Data], bool], Handler]] = [
    (_is_frame, frame),
    (_is_video, video),
    (_read_only, hold),
    (_anything, prepare),
]


# --- what the kinds share -------------------------------------------------------------------


def _video(process: Process, source: str, unit: Unit) -> bytes | Path:
    """Where a video's bytes are for a reader: its file (kiln run), else fetched once and kept
    for the units after."""
    path = process.fetcher.local_path(source)
    if path is not None:
        if not path.is_file():
            raise InputError(f"There is no file at {path}.")
        return path
    data = process.videos.held(source)
    if data is None:
        data = process.fetcher.fetch(source, unit.max_bytes)
        process.videos.hold(source, data)
    return data


def _limits(settings: PrepSettings) -> VideoLimits:
    return VideoLimits(settings.max_video_frames, settings.max_video_duration_s)


def is_video(data: bytes) -> bool:
    if _plain_jpeg(data):
        return False
    return container_of(data[:HEAD_BYTES]) is not None


def _plain_jpeg(data: bytes) -> bool:
    """Bytes `container_of` would say no to, told at a glance: a JPEG's start (FF D8 FF)
    is none of its signatures, and what it could still find — an MP4 box name (letters
    all) at 4:8, or an MPEG-TS sync byte (0x47) at 4 — is not there. A shortcut for the
    common case, exact (tests/workers/prep/test_handlers.py)."""
    return data[:3] == b"\xff\xd8\xff" and data[4:5] != b"\x47" and not data[4:8].isalpha()


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
