"""A video's index: its stream's packets read, none decoded, into every frame's presentation
time (seconds from the first frame shown) and the keyframes among them. The index is the truth
of which frame is on screen when — for the plan of what a job samples, for the reader that
decodes a frame, and for the thumbnail the API draws of it.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.app.video.container import header_seconds
from kiln.app.video.sampling import sample_count

log = logging.getLogger(__name__)

EPS = 1e-6  # seconds: a frame shown at t has a time ≤ t + EPS
REORDER = 32  # packets read past a moment: more than any decoder holds back to reorder


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

    def ends_before(self, t: float) -> bool:
        """Whether no frame is on screen at `t`: the video (or what decodes of it) ended."""
        return not self.times or t >= self.end_s - EPS

    def shown_at(self, t: float) -> int:
        """The index of the frame on screen at `t` (the first frame before it starts)."""
        return max(0, bisect.bisect_right(self.times, t + EPS) - 1)

    def time_shown_at(self, t: float) -> float:
        """The time of the frame on screen at `t`."""
        return self.times[self.shown_at(t)]

    def gop_of(self, t: float) -> int:
        return max(0, bisect.bisect_right(self.keyframes, t + EPS) - 1)

    def keyframe_before(self, t: float) -> float:
        i = bisect.bisect_right(self.keyframes, t + EPS) - 1
        return self.keyframes[i] if i >= 0 else 0.0

    def decodable_moments(self, fps: float) -> int:
        """How many of the moments k/`fps` (> 0) fall before the decodable end."""
        total = sample_count(self.duration_s, fps)
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
        total = sample_count(self.duration_s, fps)
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


def read_index(container: Any, stream: Any, until: float | None = None) -> VideoIndex:
    """Every packet of the stream, none decoded: their times, their keyframes. A file cut
    short ends the index where its packets end. `until`: only the packets up to a little past
    that moment (a reader of one frame, the API's thumbnail, reads no further)."""
    base = float(stream.time_base)
    packets = _packets(container, stream)
    if until is not None:
        packets = _up_to(packets, base, until)
    stamps: list[int] = []
    keys: list[int] = []
    durations: list[float] = []
    for pts, keyframe, duration in packets:
        stamps.append(pts)
        if keyframe:
            keys.append(pts)
        if duration:
            durations.append(duration * base)
    # Time 0 is the first frame shown, whatever the container's clock started at (an MPEG-TS
    # starts at 0.2 s or hours in; an AVI with B-frames at one frame).
    start = min(stamps) if stamps else 0
    times = sorted((pts - start) * base for pts in stamps)
    keyframes = sorted((pts - start) * base for pts in keys)
    header_s = header_seconds(container, stream)
    return VideoIndex(
        times, keyframes or times[:1], _frame_seconds(stream, durations, times), header_s,
        stream.frames or None, start,
    )  # fmt: skip


def _packets(container: Any, stream: Any) -> Iterator[tuple[int, bool, int]]:
    """The stream's packets that hold a frame: timestamp, keyframe or not, duration (in the
    stream's time base). A cut or damaged tail ends them."""
    import av

    count = 0
    try:
        for packet in container.demux(stream):
            pts = packet.pts if packet.pts is not None else packet.dts
            if pts is None or packet.size == 0:
                continue
            count += 1
            yield pts, packet.is_keyframe, packet.duration or 0
    except av.error.FFmpegError as error:  # a cut or damaged tail: the index ends here
        log.info("video index stops at %d packets: %s", count, error)


def _up_to(
    packets: Iterator[tuple[int, bool, int]], base: float, until: float
) -> Iterator[tuple[int, bool, int]]:
    """The packets up to `until` (seconds from the lowest timestamp so far) and `REORDER`
    after it: every frame shown up to then is among them."""
    low, past = None, 0
    for packet in packets:
        yield packet
        low = packet[0] if low is None else min(low, packet[0])
        if (packet[0] - low) * base > until + EPS:
            past += 1
            if past > REORDER:
                return


def _frame_seconds(stream: Any, durations: list[float], times: list[float]) -> float:
    """One frame's duration (the last frame is shown this long): its packets' median, else the
    header's rate, else the median gap between frames."""
    if durations:
        return float(np.median(durations))
    if rate := stream.average_rate or stream.guessed_rate:
        return 1 / float(rate)
    return float(np.median(np.diff(times))) if len(times) > 1 else 0.0
