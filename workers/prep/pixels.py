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
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError

from kiln.app.catalog.model_spec import CROP_RATIO, Preprocessing
from kiln.app.core.errors import InputError


@dataclass(frozen=True)
class Letterbox:
    """How an image was fitted into the model's square input, to map boxes back."""

    scale: float
    width: int
    height: int

    @property
    def scales(self) -> tuple[float, float]:
        """Model pixels per original pixel, across and down."""
        return self.scale, self.scale


@dataclass(frozen=True)
class Squash:
    """How an image was stretched onto the model's square input (aspect not kept)."""

    scale_x: float
    scale_y: float
    width: int
    height: int

    @property
    def scales(self) -> tuple[float, float]:
        return self.scale_x, self.scale_y


# Where a detector's boxes are mapped back from: a letterboxed or a squashed image.
Placement = Letterbox | Squash

# Pillow's resampling filter for each name a spec may declare.
FILTERS = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
    "nearest": Image.Resampling.NEAREST,
}
BILINEAR = Image.Resampling.BILINEAR


@dataclass(frozen=True)
class Decoded:
    """An RGB image, possibly decoded at reduced scale, and its full upright size.

    `jpeg`: the source was a JPEG, already lossy, so resizing may take shortcuts that land
    within a level or two of Pillow's full path; every other format keeps that path exactly."""

    image: Image.Image
    width: int
    height: int
    jpeg: bool = False


# The upright size an image of this full upright size will be resized to: what a JPEG may be
# drafted down to, never below.
Sizer = Callable[[int, int], tuple[int, int]]

_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height
_TRANSPOSED = {2, 3, 4, *_ROTATED}  # orientations `exif_transpose` acts on


# Every file an image model is given may be an image or a video (told by its bytes, never its
# name); one that is neither — a text named `.jpg` or `.mp4` — is answered so.
NOT_IMAGE_OR_VIDEO = "The file is neither an image nor a video Kiln can read."
# What Pillow raises on broken files, depending on where the damage is.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError)


def decode_image(data: bytes, *, max_pixels: int, draft_to: int | Sizer | None = None) -> Decoded:
    """Bytes → upright RGB image; bad or oversized input raises `InputError`.

    `draft_to` (a square side, or a `Sizer`) lets a JPEG decode at a reduced DCT scale that
    still covers it, which costs a fraction of a full decode."""
    image = open_image(data, max_pixels)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            orientation = image.getexif().get(0x0112)
            width, height = image.size
            if orientation in _ROTATED:
                width, height = height, width
            jpeg = isinstance(image, JpegImagePlugin.JpegImageFile)
            if jpeg and draft_to:
                target = draft_to(width, height) if callable(draft_to) else (draft_to, draft_to)
                _draft(image, target, rotated=orientation in _ROTATED)
            image.load()
            if orientation in _TRANSPOSED:  # otherwise `exif_transpose` only copies
                image = ImageOps.exif_transpose(image)
            return Decoded(_to_rgb(image), width, height, jpeg)
    except Image.DecompressionBombError as error:
        raise _too_large(error, max_pixels) from None
    except _DECODE_ERRORS as error:
        raise InputError(f"The image could not be decoded: {error}.") from None


def _draft(image: Image.Image, target: tuple[int, int], *, rotated: bool) -> None:
    """Decode at 1/2, 1/4 or 1/8 scale, the smallest that still covers the upright `target` on
    both sides; a source under twice the target on either side gains nothing, so decodes in
    full (as Pillow would, but without touching its decoder settings)."""
    want_w, want_h = (target[1], target[0]) if rotated else target  # the stored orientation
    if image.width >= 2 * want_w and image.height >= 2 * want_h:
        image.draft("RGB", (want_w, want_h))


_WIDE_GREY = {"I", "I;16", "I;16B", "I;16L", "I;16N"}  # 16-bit greyscale PNG and TIFF


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB from any mode. Pillow's own conversion of 16-bit grey clips at 255 (a white
    picture), so those keep their high byte instead."""
    if image.mode in _WIDE_GREY:
        pixels = np.asarray(image)
        if pixels.dtype.kind == "i":
            pixels = np.clip(pixels, 0, 0xFFFF)
        image = Image.fromarray((pixels >> 8).astype(np.uint8))
    return image if image.mode == "RGB" else image.convert("RGB")  # convert would copy


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


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Read the header only, and refuse decompression bombs before any pixel is decoded."""
    if not data:
        raise InputError("The file is empty.")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning; Kiln's cap below decides, with a sentence.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image: Image.Image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InputError(NOT_IMAGE_OR_VIDEO) from None
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


def letterbox_size(width: int, height: int, size: int) -> tuple[int, int]:
    """The size an image fitted into a `size` square takes: its longest side is `size`.
    Also the `Sizer` a letterboxing model drafts JPEGs to, so shapes match a full decode's."""
    scale = size / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def letterbox(
    decoded: Decoded, size: int, resample: Image.Resampling = BILINEAR
) -> tuple[np.ndarray, Letterbox]:
    """Fit the longest side to `size`, pad right and bottom with black: uint8 HWC."""
    image, width, height = decoded.image, decoded.width, decoded.height
    new_w, new_h = letterbox_size(width, height, size)
    if image.size != (new_w, new_h):  # a JPEG drafted to exactly the fit needs no resize
        image = image.resize((new_w, new_h), resample)
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    canvas[:new_h, :new_w] = np.asarray(image)
    return canvas, Letterbox(size / max(width, height), width, height)


def squash(
    decoded: Decoded, size: int, resample: Image.Resampling = BILINEAR
) -> tuple[np.ndarray, Squash]:
    """Resize to `size` × `size`, aspect not kept: uint8 HWC."""
    image, width, height = decoded.image, decoded.width, decoded.height
    if image.size != (size, size):
        image = image.resize((size, size), resample)
    return np.asarray(image), Squash(size / width, size / height, width, height)


def squash_size(_width: int, _height: int, size: int) -> tuple[int, int]:
    """The `Sizer` a squashing model drafts JPEGs to: the square itself."""
    return size, size


def resize_side(size: int, crop_ratio: float = CROP_RATIO) -> int:
    """The short side an image is resized to before its centre `size` crop."""
    return round(size / crop_ratio)


def crop_resize_size(
    width: int, height: int, size: int, crop_ratio: float = CROP_RATIO
) -> tuple[int, int]:
    """The size an image is resized to before its centre `size` crop: the short side becomes
    `resize_side`. Also the `Sizer` a centre-cropping model drafts JPEGs to."""
    scale = resize_side(size, crop_ratio) / min(width, height)
    return max(size, round(width * scale)), max(size, round(height * scale))


def center_crop(
    decoded: Decoded,
    size: int,
    crop_ratio: float = CROP_RATIO,
    resample: Image.Resampling = BILINEAR,
) -> np.ndarray:
    """Resize the short side to size/crop_ratio and take the centre square: uint8 HWC."""
    image = decoded.image
    width, height = image.size
    resized_w, resized_h = crop_resize_size(width, height, size, crop_ratio)
    left, top = (resized_w - size) // 2, (resized_h - size) // 2
    if (resized_w, resized_h) == (width, height):
        return np.asarray(image.crop((left, top, left + size, top + size)))
    if decoded.jpeg:
        # Resample only the square that is kept, straight from the (drafted) decode: the same
        # filter and footprint, but the float box moves a few pixels by a level or two, so only
        # for a JPEG, whose pixels are approximate anyway.
        x, y = width / resized_w, height / resized_h
        box = (left * x, top * y, (left + size) * x, (top + size) * y)
        return np.asarray(image.resize((size, size), resample, box=box))
    resized = image.resize((resized_w, resized_h), resample)
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def fit_size(pre: Preprocessing, width: int, height: int) -> tuple[int, int]:
    """The size `fit_image` resizes an image of this full upright size to: the `Sizer` a
    registered model drafts JPEGs to."""
    if pre.fit == "crop":
        return crop_resize_size(width, height, pre.input_size, pre.crop_ratio)
    if pre.fit == "letterbox":
        return letterbox_size(width, height, pre.input_size)
    return squash_size(width, height, pre.input_size)


def fit_image(decoded: Decoded, pre: Preprocessing) -> tuple[np.ndarray, Placement | None]:
    """The model's `input_size` square as `pre` declares it (uint8 HWC RGB), and where a
    letterboxed or squashed image lies in it (None for a crop: nothing is mapped back)."""
    resample = FILTERS[pre.resize_filter]
    if pre.fit == "crop":
        return center_crop(decoded, pre.input_size, pre.crop_ratio, resample), None
    if pre.fit == "letterbox":
        return letterbox(decoded, pre.input_size, resample)
    return squash(decoded, pre.input_size, resample)


def normalize(
    xp: ModuleType,
    batch: Any,
    *,
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0),
    std: tuple[float, float, float] = (1.0, 1.0, 1.0),
    scale: float = 1 / 255,
    layout: str = "NCHW",
    dtype: str = "float32",
    channel_order: str = "RGB",
) -> Any:
    """uint8 NHWC RGB → (x·scale − mean) / std in `channel_order`, `layout` and `dtype`, on
    `xp`: one multiply that reads the (transposed) uint8 view and writes the float array, and
    one add in place — no float temporaries (far cheaper than the textbook chain on NumPy).
    mean and std are in `channel_order`."""
    if batch.ndim != 4 or batch.shape[-1] != 3:
        raise ValueError(f"Expected an NHWC batch with 3 channels, got shape {batch.shape}.")
    if channel_order == "BGR":
        batch = batch[..., ::-1]  # a view: the multiply below makes the one copy
    elif channel_order != "RGB":
        raise ValueError(f"Unknown channel order {channel_order!r}; use RGB or BGR.")
    inv_std = 1.0 / xp.asarray(std, dtype=xp.float32)
    gain = xp.float32(scale) * inv_std  # x·scale/std − mean/std: the same value, two passes
    shift = -xp.asarray(mean, dtype=xp.float32) * inv_std
    if layout == "NCHW":
        batch = batch.transpose(0, 3, 1, 2)
        gain, shift = gain.reshape(1, 3, 1, 1), shift.reshape(1, 3, 1, 1)
    elif layout != "NHWC":
        raise ValueError(f"Unknown layout {layout!r}; use NCHW or NHWC.")
    out = xp.empty(batch.shape, dtype=xp.float32)
    xp.multiply(batch, gain, out=out)
    out += shift
    return out if dtype == "float32" else out.astype(dtype)


def stack(rows: list[np.ndarray]) -> np.ndarray:
    return np.stack(rows) if rows else np.empty((0, 0, 0, 3), dtype=np.uint8)
