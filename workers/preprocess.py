"""Decode and resize on the CPU; normalise and lay out once per batch over an array module.

`normalize` takes `xp` (NumPy here, CuPy on a GPU) so the same code is tested on CPU and
used on a device. Decoding stays uint8 per image because float work per image costs more
than one vectorised pass over the batch.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError

from kiln.app.core.errors import InputError


@dataclass(frozen=True)
class Letterbox:
    """How an image was fitted into the model's square input, to map boxes back."""

    scale: float
    width: int
    height: int


@dataclass(frozen=True)
class Decoded:
    """An RGB image, possibly decoded at reduced scale, and its full upright size."""

    image: Image.Image
    width: int
    height: int


_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


# What Pillow raises on broken files, depending on where the damage is.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError)


def decode_image(data: bytes, *, max_pixels: int, draft_to: int | None = None) -> Decoded:
    """Bytes → upright RGB image; bad or oversized input raises `InputError`."""
    image = _open(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            width, height = image.size
            if image.getexif().get(0x0112) in _ROTATED:
                width, height = height, width
            if draft_to and isinstance(image, JpegImagePlugin.JpegImageFile):
                # JPEG decodes at 1/2, 1/4 or 1/8 scale directly: far cheaper than in full.
                image.draft("RGB", (draft_to, draft_to))
            image = ImageOps.exif_transpose(image) or image
            return Decoded(_to_rgb(image), width, height)
    except Image.DecompressionBombError as error:
        raise _too_large(error, max_pixels) from None
    except _DECODE_ERRORS as error:
        raise InputError(f"The image could not be decoded: {error}.") from None


_WIDE_GREY = {"I", "I;16", "I;16B", "I;16L", "I;16N"}  # 16-bit greyscale PNG and TIFF


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB from any mode. Pillow's own conversion of 16-bit grey clips at 255 (a white
    picture), so those keep their high byte instead."""
    if image.mode in _WIDE_GREY:
        pixels = np.asarray(image)
        if pixels.dtype.kind == "i":
            pixels = np.clip(pixels, 0, 0xFFFF)
        image = Image.fromarray((pixels >> 8).astype(np.uint8))
    return image.convert("RGB")


def _too_large(error: Image.DecompressionBombError, max_pixels: int) -> InputError:
    """Pillow refuses a header far over its own limit before Kiln sees the size: one sentence
    with the numbers, rather than Pillow's message."""
    claimed = re.search(r"\((\d+) pixels\)", str(error))
    pillow_limit = 2 * (Image.MAX_IMAGE_PIXELS or max_pixels)
    limit = f"the limit is {min(max_pixels, pillow_limit):,}"
    if claimed is None:
        return InputError(f"The image is too large to decode safely; {limit} pixels.")
    return InputError(
        f"The image is too large to decode safely: it claims {int(claimed[1]):,} pixels "
        f"and {limit}."
    )


def _open(data: bytes, max_pixels: int) -> Image.Image:
    """Read the header only, and refuse decompression bombs before any pixel is decoded."""
    if not data:
        raise InputError("The file is empty.")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning; Kiln's cap below decides, with a sentence.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image: Image.Image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InputError("The file is not an image Kiln can read.") from None
    except Image.DecompressionBombError as error:
        raise _too_large(error, max_pixels) from None
    except _DECODE_ERRORS as error:
        raise InputError(f"The image header is damaged: {error}.") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InputError(
            f"The image is {width}×{height} pixels, over the limit of {max_pixels:,} pixels."
        )
    return image


def letterbox(decoded: Decoded, size: int) -> tuple[np.ndarray, Letterbox]:
    """Fit the longest side to `size`, pad right and bottom with black: uint8 HWC."""
    image, width, height = decoded.image, decoded.width, decoded.height
    scale = size / max(width, height)
    new_w, new_h = max(1, round(width * scale)), max(1, round(height * scale))
    resized = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    canvas[:new_h, :new_w] = np.asarray(resized)
    return canvas, Letterbox(scale, width, height)


CROP_RATIO = 0.875  # the centre crop keeps 224 of 256 pixels, as ImageNet models expect


def resize_side(size: int, crop_ratio: float = CROP_RATIO) -> int:
    """The short side an image is resized to before its centre `size` crop."""
    return round(size / crop_ratio)


def center_crop(decoded: Decoded, size: int, crop_ratio: float = CROP_RATIO) -> np.ndarray:
    """Resize the short side to size/crop_ratio and take the centre square: uint8 HWC."""
    image = decoded.image
    width, height = image.size
    short = resize_side(size, crop_ratio)
    scale = short / min(width, height)
    resized = image.resize(
        (max(size, round(width * scale)), max(size, round(height * scale))),
        Image.Resampling.BILINEAR,
    )
    left = (resized.width - size) // 2
    top = (resized.height - size) // 2
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def normalize(
    xp: ModuleType,
    batch: Any,
    *,
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0),
    std: tuple[float, float, float] = (1.0, 1.0, 1.0),
    scale: float = 1 / 255,
    layout: str = "NCHW",
    dtype: str = "float32",
) -> Any:
    """uint8 NHWC → (x·scale − mean) / std in `layout` and `dtype`, in one pass on `xp`."""
    if batch.ndim != 4 or batch.shape[-1] != 3:
        raise ValueError(f"Expected an NHWC batch with 3 channels, got shape {batch.shape}.")
    mean_a = xp.asarray(mean, dtype=xp.float32)
    inv_std = 1.0 / xp.asarray(std, dtype=xp.float32)
    out = (batch.astype(xp.float32) * xp.float32(scale) - mean_a) * inv_std
    if layout == "NCHW":
        out = out.transpose(0, 3, 1, 2)
    elif layout != "NHWC":
        raise ValueError(f"Unknown layout {layout!r}; use NCHW or NHWC.")
    return xp.ascontiguousarray(out.astype(dtype, copy=False))


def stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.stack(rows) if rows else np.empty((0, 0, 0, 3), dtype=np.uint8)
