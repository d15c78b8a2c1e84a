"""What an image's header says, read without decoding a pixel (`read_header`): the checks a
prep process makes for the GPU-decode path, where the engine's device decodes the batch
(`workers/device/pixels.py` reads the `Header` it leaves)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import cast

from PIL import JpegImagePlugin

from kiln.workers.prep.pixels import open_image

# Modes nvJPEG turns into RGB as libjpeg does; CMYK/YCCK JPEGs go through Pillow.
_NVJPEG_MODES = {"RGB", "L"}
ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


@dataclass(frozen=True)
class Header:
    """What the header says, read without decoding a pixel: the upright size, the EXIF
    orientation (1: as stored), and whether nvJPEG may decode it."""

    width: int
    height: int
    orientation: int
    nvjpeg: bool


def read_header(data: bytes | memoryview, *, max_pixels: int) -> Header:
    """The cheap checks a task thread can make before a batch decodes: an image Kiln reads,
    under the pixel cap. Bad input raises `InputError` with `decode_image`'s sentences."""
    image = open_image(cast(bytes, data), max_pixels)  # any buffer: Pillow reads a BytesIO
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow warns on odd EXIF; the CPU path ignores it too
        orientation = int(image.getexif().get(0x0112) or 1)
    width, height = image.size
    if orientation in ROTATED:
        width, height = height, width
    jpeg = isinstance(image, JpegImagePlugin.JpegImageFile) and image.mode in _NVJPEG_MODES
    # nvJPEG decodes a truncated JPEG without an error (the missing rows come out grey), where
    # Pillow refuses it: a JPEG without its end marker goes to Pillow, which says why it fails.
    return Header(width, height, orientation, jpeg and _complete(data))


def _complete(data: bytes | memoryview) -> bool:
    """Whether the JPEG ends with its end marker (zero padding after it allowed), read in
    place: `data` may be a view of shared memory."""
    view = memoryview(data).cast("B")
    end = len(view)
    while end > 0:  # a few KiB at a time from the end: padding may be long
        start = max(0, end - 4096)
        kept = len(bytes(view[start:end]).rstrip(b"\0"))
        if kept:
            last = start + kept  # one past the last byte that is not padding
            return last >= 2 and view[last - 2] == 0xFF and view[last - 1] == 0xD9
        end = start
    return False
