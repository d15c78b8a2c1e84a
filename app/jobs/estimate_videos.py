"""What an estimate reads of a source's objects: the first bytes of objects whose name says
neither image nor video (a worker judges by bytes: `kiln.app.video.container_of`), and the
headers of a sample of videos, for the frames a job would sample from them.

A header is read through `RangedObject`, a file over ranged GETs that PyAV seeks in: an MP4
with its `moov` at the end costs a read at each end, not the whole file; past `max_bytes` read
the header is given up (the frames are then estimated from bytes).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.app.video import HEAD_BYTES, container_of, read_header, sample_count
from kiln.app.video.container import header_seconds, own_fps

BLOCK = 256 * 1024  # one ranged GET
# Bytes per second of video assumed where no sampled header could be read: 2 Mbit/s, a
# typical 720p H.264 rate. Said in the estimate's note whenever it is used.
ASSUMED_BYTES_PER_S = 250_000.0

# (key, first byte, last byte inclusive) → those bytes.
RangeReader = Callable[[str, int, int], bytes]


def s3_ranges(client: Any, bucket: str) -> RangeReader:
    def read(key: str, first: int, last: int) -> bytes:
        answer = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}")
        data: bytes = answer["Body"].read()
        return data

    return read


class TooMuchRead(OSError):
    """A header that needs more than the estimate's bound of bytes."""


class RangedObject(io.RawIOBase):
    """A read-only, seekable file over an object's ranged reads, in blocks kept once read."""

    def __init__(self, read: RangeReader, key: str, size: int, max_bytes: int) -> None:
        super().__init__()
        self._read, self.key, self.size, self.max_bytes = read, key, size, max_bytes
        self._blocks: dict[int, bytes] = {}
        self._at = 0
        self.fetched = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self.size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.size - self._at)
        if wanted <= 0:
            return 0
        done = 0
        while done < wanted:
            block, offset = divmod(self._at + done, BLOCK)
            data = self._block(block)[offset : offset + wanted - done]
            if not data:
                break
            view[done : done + len(data)] = data
            done += len(data)
        self._at += done
        return done

    def _block(self, number: int) -> bytes:
        if number not in self._blocks:
            first = number * BLOCK
            last = min(self.size, first + BLOCK) - 1
            if self.fetched + (last - first + 1) > self.max_bytes:
                raise TooMuchRead(f"{self.key}: the header needs over {self.max_bytes:,} bytes")
            self._blocks[number] = self._read(self.key, first, last)
            self.fetched += last - first + 1
        return self._blocks[number]


@dataclass(frozen=True)
class VideoHeader:
    duration_s: float | None
    frames: int | None
    fps: float | None


def header_of(read: RangeReader, key: str, size: int, max_bytes: int) -> VideoHeader | None:
    """What the video's header says, read by ranges; None where it could not be read within
    `max_bytes` (or is no video PyAV opens)."""
    if size <= max_bytes:  # small: one GET, as the worker would
        found = read_header(read(key, 0, size - 1)) if size else None
        return VideoHeader(*found) if found else None
    import av

    try:
        with av.open(RangedObject(read, key, size, max_bytes), "r") as container:
            if not container.streams.video:
                return None
            stream = container.streams.video[0]
            frames = int(stream.frames) or None
            return VideoHeader(header_seconds(container, stream), frames, own_fps(stream))
    except (av.error.FFmpegError, OSError):
        return None


def sampled_frames(header: VideoHeader, fps: float) -> int | None:
    """Frames a job at `fps` (0: every frame) samples from a video with this header — the
    rule `kiln.app.video.refusal` counts by; None where the header does not tell."""
    duration, frames, own = header.duration_s, header.frames, header.fps
    if fps == 0:
        if frames:
            return frames
        return math.ceil(duration * own) if duration and own else None
    if duration is None:
        return None
    count = sample_count(duration, fps)
    if frames:
        return min(count, frames)
    if own and own > 0:
        return min(count, sample_count(duration, own))
    return count


def frames_from_bytes(size: int, fps: float) -> int:
    """A video's sampled frames guessed from its size at `ASSUMED_BYTES_PER_S` (30 frames per
    second of its own where every frame is asked for)."""
    seconds = size / ASSUMED_BYTES_PER_S
    return sample_count(seconds, fps if fps > 0 else 30.0)


def is_video(read: RangeReader, key: str, size: int) -> bool:
    """Whether an object begins as a video does (its first bytes, as a worker judges it)."""
    if size == 0:
        return False
    return container_of(read(key, 0, min(size, HEAD_BYTES) - 1)) is not None
