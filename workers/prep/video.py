"""Videos in a prep process: which frames a video's sampling takes (its plan), and the frames
themselves, decoded with PyAV (FFmpeg) straight into a model's input.

An item that turns out to be a video is *planned*: its packets are read (no decoding, but the
first frame, to prove the codec) into a `VideoIndex` — every frame's presentation time and
the keyframes — and the job's sampling rate gives one frame item per sampled moment, never two
for one frame. A frame item is then decoded by a `VideoReader`, which each prep process keeps
open between units: it decodes on from where it stopped while the next frame wanted is before
the next keyframe, and seeks to the keyframe before it otherwise — sequential when sampling is
dense, seeking when it is sparse. The index is the truth of which frame is shown when, so a
frame whose packets did not decode fails with a sentence rather than being answered with its
neighbour.
"""

from __future__ import annotations

import bisect
import io
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from kiln.app import video
from kiln.app.core.errors import InputError
from kiln.workers.prep.pixels import Decoded

log = logging.getLogger(__name__)

EPS = 1e-6  # seconds: a frame shown at t has a time ≤ t + EPS
DRAFT_STEPS = (8, 4, 2)  # frames are reduced by one of these (or not) before the fit
SEEK_SKIP = 12  # frames decoded on rather than seeking past them (a seek flushes the decoder)
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


@dataclass(frozen=True)
class FrameRequest:
    """A frame item, as a prep unit carries it."""

    time_s: float
    fps: float  # the job's sampling rate (0: every frame): to count frames past a cut


class VideoIndex:
    """The video stream's frames as its packets tell them: presentation times (seconds from
    the stream's start, sorted), the keyframes among them, and what the header claims."""

    def __init__(
        self,
        times: list[float],
        keyframes: list[float],
        frame_s: float,
        header_s: float | None,
        header_frames: int | None,
        start_pts: int = 0,
    ) -> None:
        self.times, self.keyframes = times, keyframes
        self.start_pts = start_pts  # the first frame's timestamp: time 0
        self.frame_s = frame_s  # one frame's duration (the last frame is shown this long)
        self.header_s, self.header_frames = header_s, header_frames

    @property
    def end_s(self) -> float:
        """Where the decodable video ends."""
        return self.times[-1] + self.frame_s if self.times else 0.0

    @property
    def duration_s(self) -> float:
        """What sampling covers: the header's duration (a cut file keeps its promise, and the
        frames past the cut fail), else the packets'."""
        return self.header_s if self.header_s else self.end_s

    def shown_at(self, t: float) -> int:
        """The index of the frame on screen at `t` (the first frame before it starts)."""
        return max(0, bisect.bisect_right(self.times, t + EPS) - 1)

    def gop_of(self, t: float) -> int:
        return max(0, bisect.bisect_right(self.keyframes, t + EPS) - 1)

    def keyframe_before(self, t: float) -> float:
        i = bisect.bisect_right(self.keyframes, t + EPS) - 1
        return self.keyframes[i] if i >= 0 else 0.0

    def decodable_moments(self, fps: float) -> int:
        """How many of the moments k/`fps` (> 0) fall before the decodable end."""
        total = video.sample_count(self.duration_s, fps)
        limit = self.end_s - EPS
        k = min(total, max(0, math.ceil(limit * fps)))
        while k > 0 and (k - 1) / fps >= limit:  # k/fps as a float decides, as it is keyed
            k -= 1
        while k < total and k / fps < limit:
            k += 1
        return k

    def past_end_moments(self, fps: float) -> range:
        """The moments (k of k/`fps`, > 0) sampled after the decodable end — what a cut file
        loses — at least one frame apart, as each frame is sampled at most once."""
        total = video.sample_count(self.duration_s, fps)
        step = max(1, math.ceil(fps * self.frame_s - 1e-6))
        return range(self.decodable_moments(fps), total, step)

    def past_end(self, fps: float) -> int:
        """Sampled moments after the decodable end: what a cut file loses."""
        if fps > 0:
            return len(self.past_end_moments(fps))
        return max(0, (self.header_frames or 0) - len(self.times))

    def first_moments(self, fps: float) -> list[int]:
        """The moments k/`fps` (> 0) before the decodable end that each frame is first on
        screen at: every frame once, those no moment falls on not at all (a rate above the
        video's own repeats no frame)."""
        end = self.decodable_moments(fps)
        if end == 0:
            return []
        if end <= 3 * len(self.times):
            moments = np.arange(end, dtype=np.int64)
        else:  # sparse next to its frames: only the moments near each frame's start
            first = np.ceil((np.asarray(self.times) - EPS) * fps).astype(np.int64)
            near = np.concatenate([[0], first - 1, first, first + 1])
            moments = np.unique(near[(near >= 0) & (near < end)])
        shown = np.searchsorted(np.asarray(self.times), moments / fps + EPS, side="right")
        shown = np.maximum(0, shown - 1)  # as `shown_at`
        new = np.ones(len(moments), dtype=bool)
        new[1:] = shown[1:] != shown[:-1]
        return [int(k) for k in moments[new]]


def open_container(data: bytes | Path) -> Any:
    """PyAV's container over a file or bytes, or an InputError saying why it is not a video."""
    import av

    try:
        return av.open(str(data) if isinstance(data, Path) else io.BytesIO(data), "r")
    except (av.error.InvalidDataError, av.error.EOFError) as error:
        raise InputError(f"The file is not a video Kiln can read ({_reason(error)}).") from None
    except av.error.FFmpegError as error:
        raise InputError(f"The video could not be opened ({_reason(error)}).") from None


def video_stream(container: Any, threads: int = 0) -> Any:
    """The container's first video stream, its decoder on `threads` threads (0: FFmpeg's pick,
    about one per core) — or an InputError saying why there is none to decode."""
    streams = container.streams.video
    if not streams:
        kinds = sorted({s.type for s in container.streams}) or ["no"]
        raise InputError(
            f"The file holds {' and '.join(kinds)} streams but no video stream"
            f"{' (audio only)' if kinds == ['audio'] else ''}; there are no frames to sample."
        )
    stream = streams[0]
    if stream.codec_context is None or not stream.codec_context.codec:
        raise InputError(
            "The video's codec is not one FFmpeg knows, so Kiln cannot decode its frames."
        )
    # Frame and slice threads where this process has cores to itself; where every core has a
    # prep process of its own, one thread each (threads on shared cores only contend).
    stream.thread_type = "AUTO"
    stream.thread_count = threads
    return stream


def read_index(container: Any, stream: Any) -> VideoIndex:
    """Every packet of the stream, none decoded: their times, their keyframes. A file cut
    short ends the index where its packets end."""
    import av

    base = float(stream.time_base)
    stamps: list[int] = []
    keys: list[int] = []
    durations: list[float] = []
    try:
        for packet in container.demux(stream):
            pts = packet.pts if packet.pts is not None else packet.dts
            if pts is None or packet.size == 0:
                continue
            stamps.append(pts)
            if packet.is_keyframe:
                keys.append(pts)
            if packet.duration:
                durations.append(packet.duration * base)
    except av.error.FFmpegError as error:  # a cut or damaged tail: the index ends here
        log.info("video index stops at %d packets: %s", len(stamps), error)
    # Time 0 is the first frame shown, whatever the container's clock started at (an MPEG-TS
    # starts at 0.2 s or hours in; an AVI with B-frames at one frame).
    start = min(stamps) if stamps else 0
    times = sorted((pts - start) * base for pts in stamps)
    keyframes = sorted((pts - start) * base for pts in keys)
    rate = stream.average_rate or stream.guessed_rate
    frame_s = float(np.median(durations)) if durations else (1 / float(rate) if rate else 0.0)
    if not frame_s and len(times) > 1:
        frame_s = float(np.median(np.diff(times)))
    header_s = _header_seconds(container, stream)
    return VideoIndex(
        times, keyframes or times[:1], frame_s, header_s, stream.frames or None, start
    )


def _header_seconds(container: Any, stream: Any) -> float | None:
    if stream.duration:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / 1_000_000
    return None


def plan(data: bytes | Path, fps: float, limits: video.VideoLimits) -> FramePlan:
    """The frames `fps` samples from this video (0: every frame), or an InputError with a
    sentence: not a video, no video stream, a codec Kiln cannot decode, no timestamps, over a
    limit."""
    container = open_container(data)
    with container:
        stream = video_stream(container)
        header_s = _header_seconds(container, stream)
        frames, own = stream.frames or None, video.own_fps(stream)
        if (why := video.refusal(header_s, frames, fps, limits, own_fps=own)) is not None:
            raise InputError(why)
        index = read_index(container, stream)
        if not index.times:
            raise InputError("The video holds no frames (its stream is empty or unreadable).")
        moments = index.first_moments(fps) if fps > 0 else None
        sampled = None if moments is None else len(moments) + index.past_end(fps)
        if why := video.refusal(
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
            f"The video's first frame could not be decoded ({_reason(error)}); "
            f"its codec is {stream.codec_context.name}."
        ) from None


def _reason(error: Exception) -> str:
    text = getattr(error, "strerror", None) or str(error)
    return str(text).rstrip(".")


class VideoReader:
    """One open video in a prep process: frames by presentation time, decoding on from where
    it stopped unless a keyframe lies between (then it seeks)."""

    def __init__(
        self, data: bytes | Path, index: VideoIndex | None = None, threads: int = 0
    ) -> None:
        """`index`: the video's, read already by another reader (it is read once); `threads`:
        the decoder's (0: FFmpeg's pick)."""
        self.container = open_container(data)
        self.stream = video_stream(self.container, threads)
        self.index = index if index is not None else read_index(self.container, self.stream)
        self._base = float(self.stream.time_base)
        self._start = self.index.start_pts
        self._frames: Iterator[tuple[float, Any]] | None = None
        self._current: tuple[float, Any] | None = None  # the last frame decoded
        self._next: tuple[float, Any] | None = None  # the one after it (decoded ahead)
        self._failed: list[float] = []  # packet times that did not decode since the last seek
        self.position = -1.0  # the time of the last frame decoded (-1: needs a seek)
        self._target = -math.inf  # the frame being read: those shown before it may be skipped
        self.seeks = 0

    def frame(self, t: float, fps: float | None = None) -> Any:
        """The frame on screen at `t`, or an InputError with a sentence (`fps`: the job's
        sampling, to count what a cut file lost)."""
        if not self.index.times or t >= self.index.end_s - EPS:
            raise InputError(self.past_end_sentence(t, fps))
        target = self.index.times[self.index.shown_at(t)]
        self._target = target
        if self._must_seek(target):
            self._seek(target)
        while self._next is not None and self._next[0] <= target + EPS:
            self._current, self._next = self._next, self._pull()
        if self._current is None or abs(self._current[0] - target) > EPS:
            raise InputError(
                f"The frame shown at {target:.3f} s could not be decoded (the stream is damaged "
                "there)."
            )
        return self._current[1]

    def past_end_sentence(self, t: float, fps: float | None) -> str:
        end = self.index.end_s
        lost = self.index.past_end(fps) if fps is not None else 0
        count = (
            f"{lost:,} sampled frame{'s' if lost != 1 else ''}" if lost else "the sampled frames"
        )
        return f"The video ends at {end:.1f} s; {count} after it were not decodable."

    def continues_to(self, t: float) -> bool:
        """Whether `t` is ahead of this reader, with no keyframe worth seeking to between."""
        return self._current is not None and not self._must_seek(
            self.index.times[self.index.shown_at(t)]
        )

    def _must_seek(self, target: float) -> bool:
        if self._current is None and self._next is None:
            return True
        here = self._current[0] if self._current is not None else -math.inf
        if target < here - EPS:
            return True  # backwards
        # a keyframe well past here and before the target: decoding from it is cheaper
        key = self.index.keyframe_before(target)
        if key <= here + EPS:
            return False
        skipped = bisect.bisect_left(self.index.times, key - EPS) - self.index.shown_at(here) - 1
        return skipped > SEEK_SKIP

    def _seek(self, target: float) -> None:
        key = self.index.keyframe_before(target)
        offset = round(key / self._base) + self._start
        self.container.seek(offset, stream=self.stream, backward=True, any_frame=False)
        self.seeks += 1
        self._from(key)
        if self._next is not None and self._next[0] > key + EPS:
            # A demuxer that seeks by bytes (MPEG-TS) may land past the keyframe: the frames
            # before its landing would be missing, so decode from the start instead.
            self.container.seek(0)
            self._from(key)

    def _from(self, key: float) -> None:
        """Decode from where the container stands to the keyframe `key` (a demuxer may land
        on an earlier one)."""
        self._frames = self._decode()
        self._current, self._next = None, self._pull()
        while self._next is not None and self._next[0] < key - EPS:
            self._current, self._next = self._next, self._pull()
        self._current = None

    def _pull(self) -> tuple[float, Any] | None:
        assert self._frames is not None
        return next(self._frames, None)

    def _decode(self) -> Iterator[tuple[float, Any]]:
        """Frames in presentation order from the current position. A packet that does not
        decode, or a frame FFmpeg concealed (patched with older pixels), breaks the chain:
        nothing is given out again until a clean keyframe, so a damaged frame — or one built
        on it — fails by the index's reckoning instead of passing as its neighbour."""
        import av

        broken = False
        context = self.stream.codec_context
        for packet in self.container.demux(self.stream):
            # A frame shown before the one being read, that no other frame refers to, is never
            # looked at: FFmpeg need not decode it (sparse sampling decodes far fewer frames;
            # reference frames are still decoded, so what is shown is exact).
            pts = packet.pts
            early = pts is not None and (pts - self._start) * self._base < self._target - EPS
            context.skip_frame = "NONREF" if early else "DEFAULT"
            try:
                frames = packet.decode()
            except av.error.FFmpegError as error:
                log.debug("a packet did not decode: %s", error)
                broken = True
                continue
            for frame in frames:
                if frame.pts is None:
                    continue
                if frame.is_corrupt:
                    broken = True
                    continue
                if broken and not frame.key_frame:
                    continue
                broken = False
                t = (frame.pts - self._start) * self._base
                self.position = t
                yield t, frame

    def close(self) -> None:
        self.container.close()


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
