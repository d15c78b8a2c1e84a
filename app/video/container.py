"""A video's container: its bytes recognised by content, what its header claims, and PyAV's
container and video stream opened — or a sentence saying why there is none to decode.

PyAV (FFmpeg's libraries) is imported inside the functions that open a video, so a process
that only recognises bytes never loads it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, NamedTuple

from kiln.app.core.errors import InputError

HEAD_BYTES = 1024  # enough of a file to tell its container
TS_PACKET = 188

# ISO BMFF brands that are still images (HEIC, AVIF), not movies: Pillow's business, not ours.
_IMAGE_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif"}
_MP4_BOXES = {b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip", b"pnot"}


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
            duration = header_seconds(container, stream)
            return Header(duration, int(stream.frames) or None, own_fps(stream))
    except av.error.FFmpegError:
        return None


def header_seconds(container: Any, stream: Any) -> float | None:
    """How long the header says the video lasts: the stream's duration, else the container's."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration) / 1_000_000
    return None


def own_fps(stream: Any) -> float | None:
    """A PyAV video stream's frame rate as its header says (None where it says none)."""
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else None


def open_container(data: bytes | Path) -> Any:
    """PyAV's container over a file or bytes, or an InputError saying why it is not a video."""
    import av

    try:
        return av.open(str(data) if isinstance(data, Path) else io.BytesIO(data), "r")
    except (av.error.InvalidDataError, av.error.EOFError) as error:
        raise InputError(f"The file is not a video Kiln can read ({reason(error)}).") from None
    except av.error.FFmpegError as error:
        raise InputError(f"The video could not be opened ({reason(error)}).") from None


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


def reason(error: Exception) -> str:
    """FFmpeg's own words for an error, to end a sentence of ours in brackets."""
    text = getattr(error, "strerror", None) or str(error)
    return str(text).rstrip(".")
