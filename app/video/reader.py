"""A video's frames by presentation time, decoded with PyAV: the one reader for the prep
processes (which keep it open between units) and the API's thumbnails (one frame each).

It decodes on from where it stopped while the next frame wanted is before the next keyframe,
and seeks to the keyframe before it otherwise — sequential when sampling is dense, seeking when
it is sparse. The corrupt-frame rule: the index is the truth of which frame is shown when, and
a frame whose packets did not decode, that FFmpeg concealed, or that is built on such a frame,
fails with a sentence rather than being answered with its neighbour's pixels.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.app.core.errors import InputError
from kiln.app.video.container import open_container, video_stream
from kiln.app.video.index import EPS, VideoIndex, read_index

log = logging.getLogger(__name__)

SEEK_SKIP = 12  # frames decoded on rather than seeking past them (a seek flushes the decoder)


class VideoReader:
    """One open video: frames by presentation time, decoding on from where it stopped unless a
    keyframe lies between (then it seeks)."""

    def __init__(
        self,
        data: bytes | Path,
        index: VideoIndex | None = None,
        threads: int = 0,
        until: float | None = None,
    ) -> None:
        """`index`: the video's, read already by another reader (it is read once); `threads`:
        the decoder's (0: FFmpeg's pick); `until`: without an index, index the packets only
        that far (a reader of frames up to that moment). An InputError says why the video
        cannot be read."""
        self.container = open_container(data)
        try:
            self.stream = video_stream(self.container, threads)
            if index is None:
                index = read_index(self.container, self.stream, until)
        except BaseException:
            self.container.close()
            raise
        self.index = index
        self._base = float(self.stream.time_base)
        self._start = self.index.start_pts
        self._frames: Iterator[tuple[float, Any]] | None = None
        self._current: tuple[float, Any] | None = None  # the last frame decoded
        self._next: tuple[float, Any] | None = None  # the one after it (decoded ahead)
        self.position = -1.0  # the time of the last frame decoded (-1: needs a seek)
        self._target = -math.inf  # the frame being read: those shown before it may be skipped
        self.seeks = 0

    def frame(self, t: float, fps: float | None = None) -> Any:
        """PyAV's frame on screen at `t`, or an InputError with a sentence (`fps`: the job's
        sampling, to count what a cut file lost)."""
        if self.index.ends_before(t):
            raise InputError(self.past_end_sentence(t, fps))
        target = self.index.time_shown_at(t)
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
        return self._current is not None and not self._must_seek(self.index.time_shown_at(t))

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
