"""Decode, fit and normalise a batch of images on the torch engine's device.

The device twin of `pixels`: on CUDA, JPEGs decode in one batched call of the GPU's JPEG
decoder (`decoders`: nvImageCodec or torchvision's nvJPEG); every other image (PNG, a JPEG the
decoder refuses, a host without one) decodes on the CPU with Kiln's own `decode_image` (its
pixel cap, EXIF orientation and mode handling) and is uploaded. Resizing and normalising then
run as torch ops on whatever device the images are on, so the same code runs on the CPU in the
tests.

A bad image is reported per image (an `InputError` in its place), never by failing the batch:
a pipeline fails that item alone. `torch` and `torchvision` are imported inside functions, so
this module imports without them and a process that never calls it stays torch-free.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from PIL import JpegImagePlugin

from kiln.app.core.errors import InputError
from kiln.app.model_spec import Preprocessing
from kiln.workers.device import decoders
from kiln.workers.device.decoders import JpegDecoder
from kiln.workers.prep.pixels import (
    Letterbox,
    Squash,
    crop_resize_size,
    decode_image,
    letterbox_size,
    open_image,
)

# Filters torch resamples as Pillow does: bilinear and bicubic through the antialiased kernels
# (Pillow's own, with its a = -0.5 cubic, in both directions), nearest as "nearest-exact"
# (Pillow samples pixel centres). Lanczos has no torch kernel: such a model stays on the CPU.
DEVICE_FILTERS = {"bilinear": "bilinear", "bicubic": "bicubic", "nearest": "nearest-exact"}

# Modes nvJPEG turns into RGB as libjpeg does; CMYK/YCCK JPEGs go through Pillow.
_NVJPEG_MODES = {"RGB", "L"}
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def supports(pre: Preprocessing) -> bool:
    """Whether `fit_batch` can make this model's input (its resize filter has a torch kernel)."""
    return pre.resize_filter in DEVICE_FILTERS


# --- decoding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Header:
    """What the header says, read without decoding a pixel: the upright size, the EXIF
    orientation (1: as stored), and whether nvJPEG may decode it."""

    width: int
    height: int
    orientation: int
    nvjpeg: bool


def read_header(data: bytes, *, max_pixels: int) -> Header:
    """The cheap checks a task thread can make before a batch decodes: an image Kiln reads,
    under the pixel cap. Bad input raises `InputError` with `decode_image`'s sentences."""
    image = open_image(data, max_pixels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow warns on odd EXIF; the CPU path ignores it too
        orientation = int(image.getexif().get(0x0112) or 1)
    width, height = image.size
    if orientation in _ROTATED:
        width, height = height, width
    jpeg = isinstance(image, JpegImagePlugin.JpegImageFile) and image.mode in _NVJPEG_MODES
    # nvJPEG decodes a truncated JPEG without an error (the missing rows come out grey), where
    # Pillow refuses it: a JPEG without its end marker goes to Pillow, which says why it fails.
    complete = data.rstrip(b"\0").endswith(b"\xff\xd9")
    return Header(width, height, orientation, jpeg and complete)


def decode_batch(
    datas: Sequence[bytes | np.ndarray],
    device: Any,
    *,
    max_pixels: int,
    nvjpeg: bool | None = None,
    headers: Sequence[Header] | None = None,
    decoder: JpegDecoder | None = None,
) -> list[Any]:
    """Each image as an upright CHW uint8 RGB tensor on `device`, or the `InputError` that
    says why it could not be decoded, in the order given. `nvjpeg` (default: on a CUDA
    device) sends JPEGs through `decoder` (default: `decoders.jpeg_decoder()`, the GPU's best)
    on the current stream. `headers`: read already (by the prep processes), so not read
    again."""
    import torch

    where = torch.device(device)
    read: list[Header | InputError] = (
        list(headers) if headers is not None
        else [_header_or_error(cast(bytes, data), max_pixels) for data in datas]
    )  # fmt: skip
    results: list[Any] = list(read)  # errors stay; headers are replaced by pixels
    for i, data in enumerate(datas):
        if isinstance(data, np.ndarray):  # a video frame, decoded in prep: HWC RGB uint8
            results[i] = torch.from_numpy(data).to(where, non_blocking=True).permute(2, 0, 1)
    on_device = [i for i, h in enumerate(read) if isinstance(h, Header) and h.nvjpeg]
    if (where.type == "cuda" if nvjpeg is None else nvjpeg) and on_device:
        if decoder is None:
            decoder = decoders.jpeg_decoder("auto", str(where))
        jpegs = [cast(bytes, datas[i]) for i in on_device]
        decoded = decoder.decode(jpegs, where) if decoder is not None else [None] * len(jpegs)
        for i, tensor in zip(on_device, decoded, strict=True):
            header = read[i]
            if tensor is not None and isinstance(header, Header):
                results[i] = orient(tensor, header.orientation)  # decoders leave EXIF be
    for i, result in enumerate(results):
        if isinstance(result, Header):  # not decoded on the device: Pillow, then upload
            results[i] = _on_cpu(cast(bytes, datas[i]), where, max_pixels)
    return results


def _header_or_error(data: bytes, max_pixels: int) -> Header | InputError:
    try:
        return read_header(data, max_pixels=max_pixels)
    except InputError as error:
        return error


def _on_cpu(data: bytes, device: Any, max_pixels: int) -> Any:
    """Kiln's CPU decode (no draft: the device resizes from full size), uploaded as CHW."""
    import torch

    try:
        decoded = decode_image(data, max_pixels=max_pixels)
    except InputError as error:
        return error
    pixels = np.array(decoded.image, dtype=np.uint8)  # a writable copy torch may share
    return torch.from_numpy(pixels).permute(2, 0, 1).to(device)


def orient(image: Any, orientation: int) -> Any:
    """A CHW tensor as stored → upright, as Pillow's `exif_transpose` turns it."""
    import torch

    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1, -2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return torch.rot90(image, -1, dims=(-2, -1))  # 90° clockwise
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1, -2)
    if orientation == 8:
        return torch.rot90(image, 1, dims=(-2, -1))  # 90° counter-clockwise
    return image


# --- fitting -----------------------------------------------------------------------------


def fit_batch(images: Sequence[Any], pre: Preprocessing) -> tuple[Any, list[dict[str, Any]]]:
    """The engines' uint8 NHWC input for upright CHW uint8 `images` (all on one device), and
    per image the fit the CPU path records (`{"fit": …}`). Images of one size are resized in
    one call: a bucket's worth of camera photos is usually one or two sizes, not one kernel
    launch per image."""
    import torch

    if not supports(pre):
        raise ValueError(f"The {pre.resize_filter} filter has no torch kernel; fit on the CPU.")
    size = pre.input_size
    if not images:
        return torch.empty((0, size, size, 3), dtype=torch.uint8), []
    groups: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        groups.setdefault((int(image.shape[-2]), int(image.shape[-1])), []).append(i)
    metas: list[dict[str, Any]] = [{} for _ in images]
    if len(groups) == 1:  # the common case: no scatter
        fitted, meta = fit_group(torch.stack(list(images)), pre)
        return _nhwc(fitted), [dict(meta) for _ in images]
    out = torch.empty((len(images), size, size, 3), dtype=torch.uint8, device=images[0].device)
    for members in groups.values():
        fitted, meta = fit_group(torch.stack([images[i] for i in members]), pre)
        out[members] = _nhwc(fitted)
        for i in members:
            metas[i] = dict(meta)
    return out, metas


def _nhwc(pixels: Any) -> Any:
    """Whole, clipped float values → the uint8 NHWC contract (contiguous: the graph's copy
    and channels_last both want NHWC memory)."""
    import torch

    return pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def fit_on_device(image: Any, pre: Preprocessing) -> tuple[Any, dict[str, Any]]:
    """One image's `input_size` square (float32 CHW holding whole pixel values, as the CPU
    path's uint8) and its meta: `{"fit": Letterbox | Squash}`, or `{}` for a crop."""
    fitted, meta = fit_group(image.unsqueeze(0), pre)
    return fitted[0], meta


def fit_group(images: Any, pre: Preprocessing) -> tuple[Any, dict[str, Any]]:
    """`fit_on_device` for an NCHW uint8 stack of images of one size, in one call per pass."""
    import torch

    size, height, width = pre.input_size, int(images.shape[-2]), int(images.shape[-1])
    if pre.fit == "crop":
        resized_w, resized_h = crop_resize_size(width, height, size, pre.crop_ratio)
        left, top = (resized_w - size) // 2, (resized_h - size) // 2
        resized = resize(images, resized_w, resized_h, pre.resize_filter)
        return resized[:, :, top : top + size, left : left + size], {}
    if pre.fit == "letterbox":
        new_w, new_h = letterbox_size(width, height, size)
        canvas = images.new_zeros((images.shape[0], 3, size, size), dtype=torch.float32)
        canvas[:, :, :new_h, :new_w] = resize(images, new_w, new_h, pre.resize_filter)
        return canvas, {"fit": Letterbox(size / max(width, height), width, height)}
    squashed = resize(images, size, size, pre.resize_filter)
    return squashed, {"fit": Squash(size / width, size / height, width, height)}


def resize(images: Any, width: int, height: int, filter_name: str) -> Any:
    """NCHW uint8 → `width` × `height` float32 holding whole pixel values. As Pillow does:
    across first, then down, each pass rounded and clipped to uint8 (bicubic overshoots, and
    Pillow clips the first pass before the second reads it)."""
    import torch

    pixels = images.to(torch.float32)
    in_h, in_w = int(images.shape[-2]), int(images.shape[-1])
    if in_w != width:
        pixels = _pass(pixels, in_h, width, filter_name)
    if in_h != height:
        pixels = _pass(pixels, height, width, filter_name)
    return pixels


def _pass(pixels: Any, height: int, width: int, filter_name: str) -> Any:
    """One resampling pass (one axis keeps its size: the kernel is the identity there)."""
    import torch.nn.functional as F

    mode = DEVICE_FILTERS[filter_name]
    if mode == "nearest-exact":
        return F.interpolate(pixels, size=(height, width), mode=mode)
    out = F.interpolate(
        pixels, size=(height, width), mode=mode, align_corners=False, antialias=True
    )
    return out.round_().clamp_(0, 255)


# --- availability -------------------------------------------------------------------------


def nvjpeg_available(device: str = "cuda", choice: str = "auto") -> bool:
    """Whether a GPU JPEG decoder (`choice`: auto, nvimgcodec, torchvision) works on
    `device` here (`decoders.jpeg_decoder` tries a tiny JPEG)."""
    return decoders.jpeg_decoder(choice, device) is not None
