"""Decode, fit and normalise a batch of images on the torch engine's device.

The device twin of `pixels`: on CUDA, JPEGs decode in one batched call of the GPU's JPEG
decoder (`decoders`: nvImageCodec or torchvision's nvJPEG); every other image (PNG, a JPEG the
decoder refuses, a host without one) decodes on the CPU with Kiln's own `decode_image` (its
pixel cap, EXIF orientation and mode handling) and is uploaded. Resizing and normalising then
run as torch ops on whatever device the images are on, so the same code runs on the CPU in the
tests.

Per batch, not per image (issue 38): every torch call releases the GIL, which the engine's
other threads hold most of the time, so the batch's images travel as one stacked tensor per
size (`Group`, made where they decode: `decode_groups`) and are fitted one resize per size
(`fit_groups`), into the model's input with its images group after group (`Fitted.order`
maps them back to the batch's rows). A group's size is its images' headers', read by prep:
no call per image to learn it. `by_row` and `fit_batch` give the same image by image, for
tools and tests.

A bad image is reported per image (an `InputError` in its place), never by failing the batch:
a predictor fails that item alone. `torch` and `torchvision` are imported inside functions, so
this module imports without them and a process that never calls it stays torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from kiln.app.catalog.model_spec import Preprocessing
from kiln.app.core.errors import InputError
from kiln.workers.device import decoders
from kiln.workers.device.decoders import JpegDecoder
from kiln.workers.prep.header import ROTATED, Header, read_header
from kiln.workers.prep.pixels import (
    Letterbox,
    Squash,
    crop_resize_size,
    decode_image,
    letterbox_size,
)

# Filters torch resamples as Pillow does: bilinear and bicubic through the antialiased kernels
# (Pillow's own, with its a = -0.5 cubic, in both directions), nearest as "nearest-exact"
# (Pillow samples pixel centres). Lanczos has no torch kernel: such a model stays on the CPU.
DEVICE_FILTERS = {"bilinear": "bilinear", "bicubic": "bicubic", "nearest": "nearest-exact"}


def supports(pre: Preprocessing) -> bool:
    """Whether `fit_batch` can make this model's input (its resize filter has a torch kernel)."""
    return pre.resize_filter in DEVICE_FILTERS


# --- decoding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """A batch's images of one size, stacked: what the decode stage hands the fit stage, one
    tensor per size rather than one per image (a camera's bucket is one or two sizes)."""

    rows: np.ndarray  # the batch's rows these images are, in the stack's order (int64)
    height: int
    width: int
    pixels: Any  # N × 3 × height × width, uint8, upright RGB, on the device


Data = bytes | memoryview | np.ndarray  # an image's bytes (any buffer), or a decoded frame


def decode_groups(
    datas: Sequence[Data],
    device: Any,
    *,
    max_pixels: int,
    nvjpeg: bool | None = None,
    headers: Sequence[Header | InputError | None] | None = None,
    decoder: JpegDecoder | None = None,
) -> tuple[list[Group], dict[int, InputError]]:
    """The batch's images decoded on `device`, stacked by size, and the `InputError` of each
    row that could not be decoded. A row is an image's bytes (bytes, or any buffer), or a
    video frame decoded in prep (an HWC RGB uint8 array: uploaded as it is).

    JPEGs nvJPEG may take (`Header.nvjpeg`) go to `decoder` in one call, when `nvjpeg` says
    so (default: when a decoder is given, or on a CUDA device, where `decoders.jpeg_decoder()`
    gives the GPU's best); the rest decode with Pillow on the host and are uploaded one stack
    per size. `headers`: read already (by the prep processes), so not read again. The torch
    calls are a few per size, whatever the batch's length, plus one per image the decoder
    stores turned (EXIF): each releases the GIL, which the engine's process pays for."""
    import torch

    where = torch.device(device)
    read = (
        list(headers) if headers is not None
        else [None if isinstance(d, np.ndarray) else _header_or_error(d, max_pixels)
              for d in datas]
    )  # fmt: skip
    failed = {i: h for i, h in enumerate(read) if isinstance(h, InputError)}
    jpegs = [i for i, h in enumerate(read) if isinstance(h, Header) and h.nvjpeg
             and not isinstance(datas[i], np.ndarray)]  # fmt: skip
    use = (decoder is not None or where.type == "cuda") if nvjpeg is None else nvjpeg
    on_device = _on_device(datas, read, jpegs, where, decoder) if use and jpegs else {}
    on_host: dict[int, np.ndarray] = {}
    for i, data in enumerate(datas):
        if i in failed or i in on_device:
            continue
        if isinstance(data, np.ndarray):  # a video frame, decoded in prep: HWC RGB uint8
            on_host[i] = data
            continue
        try:
            decoded = decode_image(cast(bytes, data), max_pixels=max_pixels)  # any buffer
            on_host[i] = np.asarray(decoded.image)
        except InputError as error:
            failed[i] = error
    return _groups(torch, where, on_device, read, on_host), failed


def _on_device(
    datas: Sequence[Data], read: Sequence[Header | InputError | None], jpegs: list[int],
    where: Any, decoder: JpegDecoder | None,
) -> dict[int, Any]:  # fmt: skip
    """The JPEGs the decoder took, upright (decoders leave EXIF be), by row."""
    if decoder is None:
        decoder = decoders.jpeg_decoder("auto", str(where))
    if decoder is None:
        return {}
    # the stand-in's decoder makes its tensors by the headers' sizes; the GPU's read the bytes
    sizes = [_stored(cast(Header, read[i])) for i in jpegs] if decoder.wants_sizes else None
    decoded = decoder.decode([cast(bytes, datas[i]) for i in jpegs], where, sizes)
    found = {}
    for i, tensor in zip(jpegs, decoded, strict=True):
        header = read[i]
        if tensor is not None and isinstance(header, Header):
            found[i] = orient(tensor, header.orientation)
    return found


def _stored(header: Header) -> tuple[int, int]:
    """(height, width) as the JPEG stores it: its header's upright size, turned back."""
    if header.orientation in ROTATED:
        return header.width, header.height
    return header.height, header.width


def _groups(
    torch: Any, where: Any, on_device: dict[int, Any],
    read: Sequence[Header | InputError | None], on_host: dict[int, np.ndarray],
) -> list[Group]:  # fmt: skip
    """One stack per size: the device's images stacked (sized by their headers: no call per
    image), the host's stacked on the host and uploaded in one copy (a size both have is two
    groups: rare, and cheaper than joining them)."""
    sizes: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for i in on_device:
        header = cast(Header, read[i])
        sizes.setdefault((header.height, header.width), ([], []))[0].append(i)
    for i, pixels in on_host.items():
        sizes.setdefault((int(pixels.shape[0]), int(pixels.shape[1])), ([], []))[1].append(i)
    groups: list[Group] = []
    for device_rows, host_rows in sizes.values():
        parts = []
        if device_rows:
            parts.extend(_stacked(torch, [on_device[i] for i in device_rows], device_rows))
        if host_rows:
            host = np.stack([on_host[i] for i in host_rows])  # a copy torch may share
            parts.append((host_rows, torch.from_numpy(host).to(where).permute(0, 3, 1, 2)))
        groups.extend(_group(rows, pixels) for rows, pixels in parts)  # a mixed size: two
    return groups


def _stacked(torch: Any, images: list[Any], rows: list[int]) -> list[tuple[list[int], Any]]:
    """`images` (of one size, their headers say) as one stack; should a decoder have made
    one another size than its header gives, as one stack per size it made."""
    try:
        return [(rows, torch.stack(images))]
    except RuntimeError:  # sizes differ: read them (a call per image, on this rare path)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for n, image in enumerate(images):
            by_size.setdefault(tuple(image.shape), []).append(n)
        return [([rows[n] for n in ns], torch.stack([images[n] for n in ns]))
                for ns in by_size.values()]  # fmt: skip


def _group(rows: list[int], pixels: Any) -> Group:
    height, width = (int(side) for side in pixels.shape[-2:])  # what was made, not said
    return Group(np.asarray(rows, dtype=np.int64), height, width, pixels)


def by_row(groups: Sequence[Group], failed: Mapping[int, InputError], rows: int) -> list[Any]:
    """`decode_groups`' answer image by image: each an upright CHW uint8 RGB tensor on its
    device (a view of its group's stack), or the `InputError` that says why it could not be
    decoded, in the order of the `rows` given (tools and tests; the stages keep the groups)."""
    results: list[Any] = [failed.get(i) for i in range(rows)]
    for group in groups:
        for row, image in zip(group.rows.tolist(), group.pixels.unbind(0), strict=True):
            results[row] = image
    return results


def _header_or_error(data: bytes | memoryview, max_pixels: int) -> Header | InputError:
    try:
        return read_header(data, max_pixels=max_pixels)
    except InputError as error:
        return error


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


@dataclass(frozen=True)
class Fitted:
    """A batch fitted: the engines' uint8 NHWC input, its images group after group; the
    batch's row of each of them (`order`); and per group, its rows and the fit the CPU path
    records (`{"fit": Letterbox | Squash}`, `{}` for a crop)."""

    pixels: Any
    order: np.ndarray
    fits: list[tuple[np.ndarray, dict[str, Any]]]


def fit_groups(groups: Sequence[Group], pre: Preprocessing, device: Any) -> Fitted:
    """The model's input for the decode stage's groups: one resize per group (about ten
    torch calls each, whatever its length), written group after group."""
    import torch

    if not supports(pre):
        raise ValueError(f"The {pre.resize_filter} filter has no torch kernel; fit on the CPU.")
    size = pre.input_size
    order = np.concatenate([g.rows for g in groups]) if groups else np.zeros(0, np.int64)
    parts = [fit_group(g.pixels, pre, g.height, g.width) for g in groups]
    fits = [(g.rows, meta) for g, (_fitted, meta) in zip(groups, parts, strict=True)]
    if len(parts) == 1:  # the common case: no copy into place
        return Fitted(_nhwc(parts[0][0]), order, fits)
    out = torch.empty((len(order), size, size, 3), dtype=torch.uint8, device=device)
    start = 0
    for group, (fitted, _meta) in zip(groups, parts, strict=True):
        stop = start + len(group.rows)
        out[start:stop].copy_(fitted.permute(0, 2, 3, 1))  # whole values: the cast is exact
        start = stop
    return Fitted(out, order, fits)


def fit_batch(images: Sequence[Any], pre: Preprocessing) -> tuple[Any, list[dict[str, Any]]]:
    """`fit_groups` for CHW uint8 `images` one by one (tools and tests): the input in the
    images' order, and each image's fit."""
    import torch

    device = images[0].device if images else "cpu"
    sizes: dict[tuple[int, int], list[int]] = {}
    for i, image in enumerate(images):
        sizes.setdefault((int(image.shape[-2]), int(image.shape[-1])), []).append(i)
    groups = [Group(np.asarray(rows, dtype=np.int64), height, width,
                    torch.stack([images[i] for i in rows]))
              for (height, width), rows in sizes.items()]  # fmt: skip
    fitted = fit_groups(groups, pre, device)
    metas: list[dict[str, Any]] = [{} for _ in images]
    for rows, meta in fitted.fits:
        for i in rows.tolist():
            metas[i] = dict(meta)
    if np.array_equal(fitted.order, np.arange(len(images))):
        return fitted.pixels, metas
    back = torch.as_tensor(np.argsort(fitted.order), device=device)  # each image's place
    return fitted.pixels[back], metas


def _nhwc(pixels: Any) -> Any:
    """Whole, clipped float values → the uint8 NHWC contract: channels-last NCHW memory seen
    as NHWC is contiguous NHWC (the graph's copy and channels_last both want it), in two
    calls."""
    import torch

    return pixels.to(dtype=torch.uint8, memory_format=torch.channels_last).permute(0, 2, 3, 1)


def fit_on_device(image: Any, pre: Preprocessing) -> tuple[Any, dict[str, Any]]:
    """One image's `input_size` square (float32 CHW holding whole pixel values, as the CPU
    path's uint8) and its meta: `{"fit": Letterbox | Squash}`, or `{}` for a crop."""
    fitted, meta = fit_group(image.unsqueeze(0), pre)
    return fitted[0], meta


def fit_group(
    images: Any, pre: Preprocessing, height: int | None = None, width: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """`fit_on_device` for an NCHW uint8 stack of images of one size (`height` × `width`, read
    from the stack when not given), in one call per pass."""
    import torch

    size = pre.input_size
    if height is None or width is None:
        height, width = int(images.shape[-2]), int(images.shape[-1])
    meta = meta_of(pre, width, height)
    if pre.fit == "crop":
        resized_w, resized_h = crop_resize_size(width, height, size, pre.crop_ratio)
        left, top = (resized_w - size) // 2, (resized_h - size) // 2
        resized = resize(images, resized_w, resized_h, pre.resize_filter, (height, width))
        return resized[:, :, top : top + size, left : left + size], meta
    if pre.fit == "letterbox":
        new_w, new_h = letterbox_size(width, height, size)
        canvas = images.new_zeros((images.shape[0], 3, size, size), dtype=torch.float32)
        canvas[:, :, :new_h, :new_w] = resize(
            images, new_w, new_h, pre.resize_filter, (height, width)
        )
        return canvas, meta
    return resize(images, size, size, pre.resize_filter, (height, width)), meta


def meta_of(pre: Preprocessing, width: int, height: int) -> dict[str, Any]:
    """The fit an image of `width` × `height` gets, as the CPU path records it: `{"fit":
    Letterbox | Squash}`, or `{}` for a crop."""
    size = pre.input_size
    if pre.fit == "letterbox":
        return {"fit": Letterbox(size / max(width, height), width, height)}
    if pre.fit == "squash":
        return {"fit": Squash(size / width, size / height, width, height)}
    return {}


def resize(
    images: Any, width: int, height: int, filter_name: str, shape: tuple[int, int] | None = None
) -> Any:
    """NCHW uint8 (of `shape`, height × width, read from `images` when not given) → `width` ×
    `height` float32 holding whole pixel values. As Pillow does: across first, then down, each
    pass rounded and clipped to uint8 (bicubic overshoots, and Pillow clips the first pass
    before the second reads it)."""
    import torch

    pixels = images.to(torch.float32)
    in_h, in_w = shape if shape is not None else (int(images.shape[-2]), int(images.shape[-1]))
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
