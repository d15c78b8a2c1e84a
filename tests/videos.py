"""Test videos, made by the tests themselves with PyAV (FFmpeg's encoders): never downloaded.

`numbered` draws each frame's own number as large text (OCR reads it back); the other makers
give the bad inputs a video item must fail with a sentence: cut short, damaged, audio only.
"""

from __future__ import annotations

import struct
from fractions import Fraction
from functools import cache
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

CONTAINERS = {"mp4": "mp4", "mov": "mov", "mkv": "matroska", "webm": "webm", "avi": "avi",
              "ts": "mpegts"}  # fmt: skip


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def number_frame(number: int, width: int, height: int) -> Image.Image:
    """White, with `number` in black, large: what OCR reads back."""
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.text((width // 8, height // 5), str(number), fill=(0, 0, 0), font=_font(height // 2))
    return image


def numbered(
    path: Path,
    seconds: float,
    fps: int = 10,
    size: tuple[int, int] = (320, 240),
    codec: str | None = None,
    gop: int | None = None,
    faststart: bool = False,
) -> Path:
    """A clip whose frame i shows the number i. The container follows the suffix; the codec
    is H.264 unless the container wants another (WebM: VP9)."""
    frames = round(seconds * fps)
    return encode(path, (number_frame(i, *size) for i in range(frames)), fps, size, codec, gop,
                  faststart)  # fmt: skip


def plain(
    path: Path, frames: int, fps: int = 10, size: tuple[int, int] = (64, 48), **kw: object
) -> Path:
    """A small clip of grey levels (frame i is level 7·i mod 256): quick to make and decode."""
    images = (Image.new("RGB", size, ((7 * i) % 256,) * 3) for i in range(frames))
    return encode(path, images, fps, size, **kw)  # type: ignore[arg-type]


def level(number: int) -> int:
    """The grey level of frame `number` of a `plain` clip."""
    return (7 * number) % 256


def grey(frame: av.VideoFrame) -> float:
    """A decoded frame's mean grey level."""
    return float(frame.to_ndarray(format="gray").mean())


def shows(frame: av.VideoFrame, number: int) -> bool:
    """Whether a decoded frame of a `plain` clip is frame `number` (its neighbours are 7 grey
    levels away)."""
    return abs(grey(frame) - level(number)) <= 3.0


def encode(
    path: Path,
    images: object,
    fps: int | Fraction,
    size: tuple[int, int],
    codec: str | None = None,
    gop: int | None = None,
    faststart: bool = False,
) -> Path:
    suffix = path.suffix.lstrip(".")
    codec = codec or ("libvpx-vp9" if suffix == "webm" else "libx264")
    options = {"movflags": "+faststart"} if faststart else {}
    with av.open(str(path), "w", format=CONTAINERS.get(suffix), options=options) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "tune": "zerolatency"} | (
                {"g": str(gop)} if gop else {}
            )
        elif gop:
            stream.codec_context.gop_size = gop
        for image in images:  # type: ignore[attr-defined]
            for packet in stream.encode(av.VideoFrame.from_image(image)):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def variable_rate(path: Path, times: list[float], size: tuple[int, int] = (160, 120)) -> Path:
    """A variable-frame-rate MKV: frame i shows i and is presented at `times[i]` seconds."""
    base = Fraction(1, 1000)
    with av.open(str(path), "w", format="matroska") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = base
        stream.options = {"preset": "ultrafast", "bf": "0"}
        for i, t in enumerate(times):
            frame = av.VideoFrame.from_image(number_frame(i, *size))
            frame.pts = round(t / base)
            frame.time_base = base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def audio_only(path: Path, seconds: float = 1.0) -> Path:
    """An MP4 holding one AAC stream and no video."""
    rate = 16_000
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate)
        samples = np.zeros((1, 1024), dtype=np.float32)
        for k in range(int(seconds * rate / 1024)):
            frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, k * 1024
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def cut(source: Path, path: Path, fraction: float) -> Path:
    """The first `fraction` of a file's bytes: a download cut short."""
    data = source.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


def claiming(source: Path, path: Path, seconds: float) -> Path:
    """An MKV whose header says it lasts `seconds` (its Segment's Duration, in milliseconds),
    whatever its frames: a header that promises more than the file holds."""
    data = bytearray(source.read_bytes())
    at = data.find(b"\x44\x89\x88")  # Duration: an 8-byte float
    assert at >= 0, f"{source} has no 8-byte Duration element"
    data[at + 3 : at + 11] = struct.pack(">d", seconds * 1000)
    path.write_bytes(bytes(data))
    return path


def damaged(source: Path, path: Path, start: float, length: float, seed: int = 0) -> Path:
    """The file with a stretch of its bytes (from `start`, `length` of it, as fractions)
    replaced by noise: a bad sector in the middle of a GOP."""
    data = bytearray(source.read_bytes())
    first, span = int(len(data) * start), int(len(data) * length)
    noise = np.random.default_rng(seed).integers(0, 256, span, dtype=np.uint8).tobytes()
    data[first : first + span] = noise
    path.write_bytes(bytes(data))
    return path
