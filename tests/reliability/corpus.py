"""A corpus of bad and odd image files, generated on the fly (nothing is committed).

`BAD` files must fail their item with a sentence; `ODD` files are valid, if unusual, and
must succeed. Each generator is small and deterministic.
"""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageDraw

from devstack.images import photo, truncated_jpeg

ORIENTATION = 0x0112


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def landmark(size: tuple[int, int] = (240, 120)) -> Image.Image:
    """A picture that looks different turned: a bright block top-left, stripes on the right."""
    image = Image.new("RGB", size, (30, 30, 30))
    draw = ImageDraw.Draw(image)
    w, h = size
    draw.rectangle([0, 0, w // 3, h // 2], fill=(250, 250, 250))
    for x in range(w // 2, w, 16):
        draw.rectangle([x, 0, x + 7, h], fill=(200, 60, 60))
    return image


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    body = kind + payload
    return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))


def png_bomb(side: int = 10_000) -> bytes:
    """A valid 1-bit grey PNG of side×side black pixels: a few KB on disk, side² pixels."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte + packed bits
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", data)
        + _png_chunk(b"IEND", b"")
    )


def png_huge_header(side: int = 60_000) -> bytes:
    """A PNG header claiming side×side RGB pixels, followed by almost no data."""
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat)


def jpeg_huge_header(side: int = 60_000) -> bytes:
    """A small JPEG whose frame header (SOF0) claims side×side pixels."""
    data = bytearray(encode(Image.new("RGB", (16, 16), (90, 120, 200)), "JPEG"))
    at = data.index(b"\xff\xc0")  # SOF0: marker, length(2), precision(1), height(2), width(2)
    data[at + 5 : at + 9] = struct.pack(">HH", side, side)
    return bytes(data)


def gif_bomb(side: int = 30_000) -> bytes:
    """A tiny GIF whose screen and frame claim side×side pixels (LZW data for one pixel)."""
    data = bytearray(encode(Image.new("P", (1, 1), 0), "GIF"))
    data[6:10] = struct.pack("<HH", side, side)  # logical screen descriptor
    at = data.index(b"\x2c")  # image descriptor: separator, left, top, width, height
    data[at + 5 : at + 9] = struct.pack("<HH", side, side)
    return bytes(data)


def zip_file() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("photo.jpg", photo(1))
    return buffer.getvalue()


def cmyk_jpeg() -> bytes:
    return encode(landmark().convert("CMYK"), "JPEG")


def png_16_bit_grey() -> bytes:
    """`landmark()` in 16-bit greyscale (every 8-bit level times 257)."""
    levels = np.asarray(landmark().convert("L"), dtype=np.uint16) * 257
    return encode(Image.fromarray(levels), "PNG")


def animated_gif() -> bytes:
    """Two frames: `landmark()` first, then the same picture upside down."""
    first = landmark()
    second = first.transpose(Image.Transpose.ROTATE_180)
    return encode(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


def exif_rotated_jpeg() -> bytes:
    """`landmark()` stored sideways (as a camera held upright does) with EXIF orientation 6,
    "turn 90° clockwise to view": upright it is `landmark()` again."""
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    return encode(sideways(), "JPEG", exif=exif, quality=95)


def sideways() -> Image.Image:
    return landmark().transpose(Image.Transpose.ROTATE_90)  # 90° counter-clockwise


def one_pixel() -> bytes:
    return encode(Image.new("RGB", (1, 1), (10, 200, 30)), "PNG")


def html_page() -> bytes:
    return b"<!doctype html><html><head><title>cat</title></head><body><img src=x></body></html>"


# name → bytes: every one must fail its item with a sentence, and nothing else.
BAD: dict[str, Callable[[], bytes]] = {
    "empty.jpg": lambda: b"",
    "truncated.jpg": truncated_jpeg,
    "bomb.png": png_bomb,
    "bomb.gif": gif_bomb,
    "huge-header.png": png_huge_header,
    "huge-header.jpg": jpeg_huge_header,
    "text.jpg": lambda: b"This is not a picture, only words in a file named .jpg.\n" * 20,
    "page.html": html_page,
    "archive.zip": zip_file,
}

# name → bytes: unusual but valid, each must succeed. All but "sideways.jpg" and
# "one-pixel.png" show `landmark()` upright, so their perceptual hashes agree.
ODD: dict[str, Callable[[], bytes]] = {
    "cmyk.jpg": cmyk_jpeg,
    "grey-16-bit.png": png_16_bit_grey,
    "animated.gif": animated_gif,
    "exif-rotated.jpg": exif_rotated_jpeg,
    "upright.jpg": lambda: encode(landmark(), "JPEG", quality=95),
    "sideways.jpg": lambda: encode(sideways(), "JPEG", quality=95),
    "one-pixel.png": one_pixel,
}
