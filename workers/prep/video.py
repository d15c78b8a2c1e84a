"""Videos in a prep process: which frames a video's sampling takes (its plan), the readers a
process keeps open between units, and a decoded frame reduced for a model's input.

An item that turns out to be a video is *planned*: its packets are read (no decoding, but the
first frame, to prove the codec) into the shared index (`kiln.app.video.index`) and the job's
sampling rate gives one frame item per sampled moment, never two for one frame. A frame item
is then decoded by the shared `VideoReader` (`kiln.app.video.reader`: seek, decode, the
corrupt-frame rule — the same reader the API's thumbnails draw with); each prep process keeps a
few open, so dense sampling decodes on where the last unit stopped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from kiln.app.core.errors import InputError
from kiln.app.video.container import (
    header_seconds,
    open_container,
    own_fps,
    reason,
    video_stream,
)
from kiln.app.video.index import VideoIndex, read_index
from kiln.app.video.reader import VideoReader
from kiln.app.video.sampling import VideoLimits, refusal
from kiln.workers.prep.pixels import Decoded

log = logging.getLogger(__name__)

DRAFT_STEPS = (8, 4, 2)  # frames are reduced by one of these (or not) before the fit
READERS = 6  # open readers per prep process (each holds a decoder's reference frames)
PER_VIDEO = 4  # of them, at most this many on one video (chunks of it interleave in a process)
HELD_VIDEO_BYTES = 512 * 2**20  # fetched videos kept for their next unit, at most


@dataclass(frozen=True)
class FramePlan:
    """The frames a job samples from one video: the moment each stands for (seconds from the
    video's start) and the index of the frame shown then (-1 past the video's end). No frame
    is in it twice: a rate above the video's own gives each frame once, at the first moment
    it is on screen."""

    times: list[float]
    indices: list[int]
    duration_s: float
    gops: list[int]  # the keyframe each is decoded from (its GOP's number; -1 past the end)


def plan(data: bytes | Path, fps: float, limits: VideoLimits) -> FramePlan:
    """The frames `fps` samples from this video (0: every frame), or an InputError with a
    sentence: not a video, no video stream, a codec Kiln cannot decode, no timestamps, over a
    limit."""
    container = open_container(data)
    with container:
        stream = video_stream(container)
        header_s = header_seconds(container, stream)
        frames, own = stream.frames or None, own_fps(stream)
        if (why := refusal(header_s, frames, fps, limits, own_fps=own)) is not None:
            raise InputError(why)
        index = read_index(container, stream)
        if not index.times:
            raise InputError("The video holds no frames (its stream is empty or unreadable).")
        moments = index.first_moments(fps) if fps > 0 else None
        sampled = None if moments is None else len(moments) + index.past_end(fps)
        if why := refusal(
            index.duration_s, index.header_frames or len(index.times), fps, limits, sampled
        ):
            raise InputError(why)
        _first_frame(container, stream)
    return frame_plan(index, fps, moments)


def frame_plan(index: VideoIndex, fps: float, moments: list[int] | None = None) -> FramePlan:
    """The frames `fps` samples (0: every frame): the one on screen at each moment k/fps, each
    frame once (at the first moment it is on screen), and past a cut the moments at least a
    frame apart. `moments`: `index.first_moments(fps)`, where the caller has them."""
    if fps > 0:
        if moments is None:
            moments = index.first_moments(fps)
        if len(moments) < (grid := index.decodable_moments(fps)):
            log.info(
                "sampling at %g frames per second would repeat this video's frames (%d in "
                "%.1f s): each is sampled once, %d items for %d moments",
                fps, len(index.times), index.end_s, len(moments), grid,
            )  # fmt: skip
        times = [k / fps for k in moments]
        indices = [index.shown_at(t) for t in times]
        past = [k / fps for k in index.past_end_moments(fps)]
        times, indices = times + past, indices + [-1] * len(past)
    else:
        times = list(index.times)
        indices = list(range(len(times)))
        missing = index.past_end(0)  # a cut file: the header's frames past the cut, at its rate
        step = index.frame_s or (index.end_s / max(1, len(times)))
        times += [index.end_s + k * step for k in range(missing)]
        indices += [-1] * missing
        keep = _distinct(times)
        times, indices = [times[k] for k in keep], [indices[k] for k in keep]
    gops = [index.gop_of(t) if i >= 0 else -1 for t, i in zip(times, indices, strict=True)]
    return FramePlan(times, indices, index.duration_s, gops)


def _distinct(times: list[float]) -> list[int]:
    """Positions of times whose keys (three decimals) differ: frames a millisecond apart are
    one moment."""
    keep: list[int] = []
    for k, t in enumerate(times):
        if not keep or round(t, 3) != round(times[keep[-1]], 3):
            keep.append(k)
    return keep


def _first_frame(container: Any, stream: Any) -> None:
    """Decode one frame: a codec FFmpeg knows by name but cannot decode says so now, once for
    the video, rather than once per frame."""
    import av

    container.seek(0)
    try:
        for _frame in container.decode(stream):
            return
    except av.error.FFmpegError as error:
        raise InputError(
            f"The video's first frame could not be decoded ({reason(error)}); "
            f"its codec is {stream.codec_context.name}."
        ) from None


class VideoReaders:
    """The readers a prep process keeps open, a few per video: a unit continues in the reader
    that last stopped before its first frame; another stretch of the same video (another chunk)
    gets a reader of its own, up to PER_VIDEO, sharing the video's index. Fetched bytes of
    remote videos are kept too (a local file is opened where it is)."""

    def __init__(self, most: int = READERS, per_video: int = PER_VIDEO, threads: int = 0) -> None:
        self.most, self.per_video, self.threads = most, per_video, threads
        self._open: list[tuple[str, VideoReader]] = []  # most recently used last
        self._bytes: OrderedDict[str, bytes] = OrderedDict()
        self._held = 0

    def reader(self, source: str, t: float, data: bytes | Path) -> VideoReader:
        """The open reader of `source` that reaches `t` without a seek; else a new one while
        the video has fewer than `per_video` (the least recently used reader of any video is
        closed past `most`); else this video's least recently used reader, which seeks."""
        mine = [i for i, (name, _) in enumerate(self._open) if name == source]
        near = [i for i in mine if self._open[i][1].continues_to(t)]
        if near or len(mine) >= self.per_video:
            entry = self._open.pop(near[-1] if near else mine[0])
            self._open.append(entry)
            return entry[1]
        index = self._open[mine[-1]][1].index if mine else None
        reader = VideoReader(data, index, self.threads)
        self._open.append((source, reader))
        if len(self._open) > self.most:
            _, old = self._open.pop(0)
            old.close()
        return reader

    def readers_of(self, source: str) -> int:
        return sum(1 for name, _ in self._open if name == source)

    def held(self, source: str) -> bytes | None:
        data = self._bytes.get(source)
        if data is not None:
            self._bytes.move_to_end(source)
        return data

    def hold(self, source: str, data: bytes) -> None:
        if source in self._bytes:
            return
        self._bytes[source] = data
        self._held += len(data)
        while self._held > HELD_VIDEO_BYTES and len(self._bytes) > 1:
            _, old = self._bytes.popitem(last=False)
            self._held -= len(old)

    def close(self) -> None:
        for _, reader in self._open:
            reader.close()
        self._open.clear()
        self._bytes.clear()
        self._held = 0


def decoded_frame(frame: Any, want: tuple[int, int] | None, mode: str = "RGB") -> Decoded:
    """A video frame as the image preps take it, reduced by FFmpeg's scaler (by 2, 4 or 8, as a
    JPEG's draft would be) where the model's fit still has at least `want` pixels — the same
    shortcut a drafted JPEG takes, on an already lossy source. `mode` "L": the scaler gives
    grey (luma) straight away, for a model that wants nothing else (phash)."""
    width, height = frame.width, frame.height
    step = 1
    if want is not None:
        step = next((s for s in DRAFT_STEPS if width // s >= want[0] and height // s >= want[1]), 1)
    fmt = "gray" if mode == "L" else "rgb24"
    if step > 1:
        pixels = frame.to_ndarray(
            format=fmt, width=max(2, width // step), height=max(2, height // step),
            interpolation="AREA",
        )  # fmt: skip
    else:
        pixels = frame.to_ndarray(format=fmt)
    return Decoded(Image.fromarray(pixels), width, height, jpeg=True)
