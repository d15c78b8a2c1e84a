"""The prep half of the image models (registered classify, embed and detect, and the built-in
detector): decode — a JPEG drafted straight to the smallest DCT scale that covers the fit —
and fit into the model's square, written as uint8 HWC RGB into the row's slot. Where the
engine decodes on the GPU (nvJPEG), only the header is checked here and the bytes go on."""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.app.catalog.model_spec import Preprocessing
from kiln.app.core.errors import InputError
from kiln.workers.prep.pixels import (
    Decoded,
    Letterbox,
    Squash,
    decode_image,
    fit_image,
    fit_size,
)

FIT_WIDTH = 4  # meta per row: scale across, scale down, upright width, height (0s for a crop)


def images_only(data: bytes | str) -> bytes:
    if isinstance(data, str):
        raise InputError("This model takes images, not text.")
    return data


class ImagePrep:
    def __init__(self, preprocessing: Preprocessing, max_pixels: int) -> None:
        self.pre = preprocessing
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> None:
        decoded = decode_image(images_only(data), max_pixels=self.max_pixels, draft_to=self._sizer)
        self.prepare_decoded(decoded, slot, meta)

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        """What a video frame of this size may be reduced to before the fit."""
        return self._sizer(width, height)

    def prepare_decoded(self, decoded: Decoded, slot: np.ndarray | None, meta: np.ndarray) -> None:
        pixels, placement = fit_image(decoded, self.pre)
        assert slot is not None
        slot[...] = pixels
        if placement is not None:
            meta[:] = placement_row(placement)

    def _sizer(self, width: int, height: int) -> tuple[int, int]:
        return fit_size(self.pre, width, height)


def header_of(data: bytes, *, max_pixels: int) -> Any:
    """`read_header`'s answer for an image (its `Header`, or its `InputError`): a plain JPEG's
    read without Pillow (`prep/jpeg.py`), anything else by Pillow."""
    from kiln.workers.prep.header import read_header
    from kiln.workers.prep.jpeg import quick_header

    return quick_header(data, max_pixels) or read_header(data, max_pixels=max_pixels)


def placement_row(placement: Letterbox | Squash) -> tuple[float, float, float, float]:
    scale_x, scale_y = placement.scales
    return scale_x, scale_y, placement.width, placement.height


class HeaderPrep:
    """For an engine that decodes the batch on the GPU: what is cheap to check (an image Kiln
    reads, under the pixel cap) without decoding a pixel; the bytes travel on — in the row's
    byte slot when they fit (the answer carries their length: `units.in_place`), else with
    the answer."""

    def __init__(self, max_pixels: int) -> None:
        self.max_pixels = max_pixels

    def prepare(self, data: bytes | str, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        encoded = images_only(data)
        header = header_of(encoded, max_pixels=self.max_pixels)
        if slot is None or len(encoded) > len(slot):
            return encoded, header
        slot[: len(encoded)] = np.frombuffer(encoded, np.uint8)
        return len(encoded), header

    def frame_size(self, width: int, height: int) -> tuple[int, int]:
        """A video frame goes whole: the device fits it, and its fit is mapped from its size."""
        return width, height

    def prepare_decoded(self, decoded: Decoded, slot: np.ndarray | None, meta: np.ndarray) -> Any:
        """A video frame, decoded in prep already: its RGB pixels travel instead of bytes."""
        return np.asarray(decoded.image), None
