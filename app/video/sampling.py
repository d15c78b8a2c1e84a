"""What a video is to Kiln, before any frame is decoded: how its bytes are recognised, which
moments of it a job samples, and the limits a video must keep.

Shared by the API (a refusal at submission where an upload's header already tells it) and the
prep processes (the same checks on an item). A sampled frame is an item keyed
`<source>#t=<seconds>` (W3C Media Fragments, three decimals): `frame_key` and `split_key`.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from kiln.app.core.errors import InputError

FPS_OPTION = "video_fps"  # a job's option (and the CLI's --video-fps): frames per second sampled
DEFAULT_FPS = 1.0
MAX_FPS = 1000.0  # past this, keys three decimals apart could name the same frame
FRAGMENT = "#t="
HEAD_BYTES = 1024  # enough of a file to tell its container

# ISO BMFF brands that are still images (HEIC, AVIF), not movies: Pillow's business, not ours.
_IMAGE_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif"}
_MP4_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"}
TS_PACKET = 188


def container_of(head: bytes) -> str | None:
    """The video container these first bytes begin, by content alone (never the name):
    'mp4' (MP4, MOV, 3GP), 'matroska' (MKV, WebM), 'avi', 'mpegts', 'mpeg' (program stream),
    'flv'; None for anything else (an image, a text, audio in its own format)."""
    if len(head) >= 12 and head[4:8] in _MP4_BOXES and _boxes(head):
        if head[4:8] == b"ftyp" and head[8:12] in _IMAGE_BRANDS:
            return None
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "avi"
    if head.startswith(b"\x00\x00\x01\xba"):
        return "mpeg"
    if head.startswith(b"FLV\x01"):
        return "flv"
    if _transport_stream(head):
        return "mpegts"
    return None


def _boxes(head: bytes) -> bool:
    """ISO BMFF boxes, not a text that happens to spell a box's name: `ftyp` and `moov` are
    trusted with a sane size; a padding box (`free`, `wide`, …) or `mdat` must be followed,
    where the size says, by another box we know."""
    size = int.from_bytes(head[:4], "big")
    kind = head[4:8]
    if size in (0, 1):  # to the end of the file / a 64-bit size follows
        return kind in (b"mdat", b"moov")
    if size < 8:
        return False
    if kind in (b"ftyp", b"moov"):
        return size <= 1 << 32 and (kind != b"ftyp" or size <= 4096)
    if size + 8 <= len(head):
        return head[size + 4 : size + 8] in _MP4_BOXES
    # a large mdat first (a camera's file, its moov at the end): a size, not letters
    return kind == b"mdat" and not all(32 <= b < 127 for b in head[:4])


def _transport_stream(head: bytes) -> bool:
    """MPEG-TS: a sync byte every 188 bytes (or 192, M2TS's timestamped packets)."""
    for start, size in ((0, TS_PACKET), (4, TS_PACKET + 4)):
        marks = range(start, min(len(head), start + 3 * size), size)
        if len(marks) >= 3 and all(head[i] == 0x47 for i in marks):
            return True
    return False


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int  # sampled frames per video (KILN_MAX_VIDEO_FRAMES)
    max_duration_s: float  # a longer video is refused (KILN_MAX_VIDEO_DURATION_S)


@dataclass(frozen=True)
class Sampling:
    """How a job samples the videos among its inputs."""

    fps: float  # frames per second of video time; 0: every frame
    limits: VideoLimits


def check_fps(value: object) -> float:
    """A job's `video_fps`, or an InputError with a sentence that echoes it as given."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InputError(f"video_fps must be a number of frames per second, not {value!r}.")
    try:
        fps = float(value)
    except ValueError:
        raise InputError(
            f"video_fps must be a number of frames per second, not {value!r}."
        ) from None
    if not math.isfinite(fps) or fps < 0 or fps > MAX_FPS:
        raise InputError(
            f"video_fps must be between 0 (every frame) and {MAX_FPS:g} frames per second, "
            f"not {_as_given(value)}."
        )
    return fps


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_given(value: int | float | str) -> str:
    """A number as the user wrote it: a form field's "-1" is -1, not '-1' (nor -1.0)."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return value.strip()
    return repr(value)


def sample_count(duration_s: float, fps: float) -> int:
    """Frames sampled at `fps` from a video this long: one at each k/fps before its end."""
    return max(1, math.ceil(duration_s * fps - 1e-9))


def sample_times(duration_s: float, fps: float) -> list[float]:
    """The moments sampled at `fps` > 0 (every frame, fps 0, is the video's own times)."""
    if fps <= 0:
        raise ValueError("sample_times takes a rate above 0; every frame has no grid.")
    return [k / fps for k in range(sample_count(duration_s, fps))]


def refusal(
    duration_s: float | None,
    frames: int | None,
    fps: float,
    limits: VideoLimits,
    sampled: int | None = None,
    own_fps: float | None = None,
) -> str | None:
    """Why a video whose header says it lasts `duration_s` (and holds `frames`, at `own_fps`
    frames per second) is refused at this sampling rate, or None. A sentence names the limit
    and how to change it. Sampling takes each frame at most once, so a rate above the video's
    own counts its frames; `sampled`: the frames a plan counted exactly, where one did."""
    if duration_s is not None and duration_s > limits.max_duration_s:
        return (
            f"The video's header says it lasts {duration_s:,.0f} s, over the "
            f"{limits.max_duration_s:,.0f} s limit (KILN_MAX_VIDEO_DURATION_S)."
        )
    if fps > 0 and duration_s is not None:
        if sampled is None:
            sampled = sample_count(duration_s, fps)
            if frames:
                sampled = min(sampled, frames)
            elif own_fps and own_fps > 0:  # a header that counts no frames: its rate
                sampled = min(sampled, sample_count(duration_s, own_fps))
        rate = f"{fps:g} frames per second"
    elif fps == 0 and frames:
        sampled, rate = frames, "every frame"
    else:
        return None
    if sampled > limits.max_frames:
        return (
            f"Sampling this {duration_s or 0:,.1f} s video at {rate} gives {sampled:,} frames, "
            f"over the {limits.max_frames:,} limit (KILN_MAX_VIDEO_FRAMES); lower video_fps."
        )
    return None


class Header(NamedTuple):
    duration_s: float | None
    frames: int | None
    fps: float | None  # the stream's own frame rate


def read_header(data: bytes) -> Header | None:
    """What a video's header says — its duration (seconds), frame count and frame rate —
    without reading its packets; None where PyAV cannot open it or it has no video stream (the
    worker's sentence says why, on the item)."""
    import av  # FFmpeg's libraries: loaded only where a video is judged

    try:
        with av.open(io.BytesIO(data), "r") as container:
            if not container.streams.video:
                return None
            stream = container.streams.video[0]
            duration = None
            if stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            elif container.duration:
                duration = float(container.duration) / 1_000_000
            return Header(duration, int(stream.frames) or None, own_fps(stream))
    except av.error.FFmpegError:
        return None


def own_fps(stream: Any) -> float | None:
    """A PyAV video stream's frame rate as its header says (None where it says none)."""
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else None


def frame_key(source_key: str, time_s: float) -> str:
    return f"{source_key}{FRAGMENT}{time_s:.3f}"


def split_key(key: str, frame_time_s: float | None) -> str:
    """The key of the file a row came from: a frame's key without its `#t=` fragment."""
    if frame_time_s is None:
        return key
    suffix = f"{FRAGMENT}{frame_time_s:.3f}"
    return key[: -len(suffix)] if key.endswith(suffix) else key
