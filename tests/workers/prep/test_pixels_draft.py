"""JPEG DCT-scaled decoding at the model's input size, and what stays exact.

A JPEG at least twice the size a model resizes it to (on both sides) decodes at 1/2, 1/4 or 1/8
scale; the resize then starts from there. The result is close to a full decode's, never the
same shape by luck: sizes come from the full upright size. Every other format decodes, resizes
and crops exactly as Pillow's full path does.
"""

from __future__ import annotations

import io
from functools import cache

import numpy as np
import pytest
from PIL import Image, ImageOps

from bench.inputs import jpeg as make_jpeg
from devstack.images import photo as flat_jpeg
from kiln.workers.prep.pixels import (
    Decoded,
    Sizer,
    center_crop,
    crop_resize_size,
    decode_image,
    letterbox,
    letterbox_size,
    normalize,
)

MAX_PIXELS = 50_000_000


@cache
def jpeg(seed: int, size: tuple[int, int]) -> bytes:
    """A photo-like JPEG (gradients, shapes, noise), made once per test run."""
    return make_jpeg(seed, size)


def quick_jpeg(size: tuple[int, int]) -> bytes:
    """Flat shapes: quick to make at any size, where only sizes matter."""
    return flat_jpeg(0, size)


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def fitted(size: int) -> Sizer:
    return lambda width, height: letterbox_size(width, height, size)


def cropped(size: int) -> Sizer:
    return lambda width, height: crop_resize_size(width, height, size)


def with_orientation(image: Image.Image, fmt: str, orientation: int) -> bytes:
    exif = image.getexif()
    exif[0x0112] = orientation
    return encode(image, fmt, exif=exif)


# ---------------------------------------------------------------- the full path, by hand


def full_rgb(data: bytes) -> Image.Image:
    """What Pillow gives with no shortcut: full decode, EXIF turned upright, RGB."""
    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


def full_crop(image: Image.Image, size: int) -> np.ndarray:
    width, height = crop_resize_size(image.width, image.height, size)
    left, top = (width - size) // 2, (height - size) // 2
    resized = image.resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(resized.crop((left, top, left + size, top + size)))


def full_letterbox(image: Image.Image, size: int) -> np.ndarray:
    width, height = letterbox_size(image.width, image.height, size)
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    canvas[:height, :width] = np.asarray(image.resize((width, height), Image.Resampling.BILINEAR))
    return canvas


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


# ---------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("size", "fit"),
    [((640, 480), (320, 240)), ((480, 640), (240, 320)), ((100, 100), (320, 320)),
     ((2000, 3), (320, 1)), ((641, 481), (320, 240))],
)  # fmt: skip
def test_letterbox_size_fits_the_longest_side(size: tuple[int, int], fit: tuple[int, int]) -> None:
    assert letterbox_size(*size, 320) == fit


@pytest.mark.parametrize(
    ("size", "resized"),
    [((640, 480), (341, 256)), ((480, 640), (256, 341)), ((100, 50), (512, 256)),
     ((3000, 10), (76800, 256))],
)  # fmt: skip
def test_crop_resize_size_sets_the_short_side(
    size: tuple[int, int], resized: tuple[int, int]
) -> None:
    assert crop_resize_size(*size, 224) == resized


# ---------------------------------------------------------------- when a JPEG is drafted


@pytest.mark.parametrize(
    ("source", "decoded"),
    [
        ((640, 480), (320, 240)),  # exactly twice the fit: 1/2, and no resize left to do
        ((1280, 960), (320, 240)),  # 1/4
        ((2560, 1920), (320, 240)),  # 1/8, the most libjpeg offers
        ((3001, 2251), (376, 282)),  # 1/8 still: sizes round up
        ((641, 481), (321, 241)),  # sizes round up: never under the fit
        ((639, 480), (639, 480)),  # under twice the fit on one side: full decode
        ((640, 299), (640, 299)),  # fit 320×150: the short side is just under twice
    ],
)
def test_a_jpeg_is_drafted_only_at_twice_the_fit_on_both_sides(
    source: tuple[int, int], decoded: tuple[int, int]
) -> None:
    result = decode_image(quick_jpeg(source), max_pixels=MAX_PIXELS, draft_to=fitted(320))
    assert result.image.size == decoded
    assert (result.width, result.height) == source
    assert result.jpeg


def test_the_letterbox_fit_drafts_further_than_a_square() -> None:
    """A 640×480 photo for a 320 detector: the fit is 320×240, so 1/2 scale; a 320×320 square
    would have needed 480 ≥ 640 and decoded in full."""
    data = jpeg(4, (640, 480))
    assert decode_image(data, max_pixels=MAX_PIXELS, draft_to=320).image.size == (640, 480)
    assert decode_image(data, max_pixels=MAX_PIXELS, draft_to=fitted(320)).image.size == (320, 240)


def test_the_draft_target_turns_with_the_exif_rotation() -> None:
    """Stored 1280×960, shown 960×1280 (orientation 6): the fit 240×320 is asked of the stored
    picture as 320×240, so 1/4 scale; unturned it would stop at 1/2."""
    image = Image.open(io.BytesIO(jpeg(4, (1280, 960))))
    data = with_orientation(image, "JPEG", 6)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=fitted(320))
    assert (decoded.width, decoded.height) == (960, 1280)
    assert decoded.image.size == (240, 320)
    pixels, fit = letterbox(decoded, 320)
    reference = full_letterbox(full_rgb(data), 320)
    assert pixels.shape == reference.shape == (320, 320, 3)
    assert fit.scale == 320 / 1280
    assert mean_abs_diff(pixels, reference) < 1.5


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "TIFF", "BMP"])
def test_other_formats_are_never_drafted(fmt: str) -> None:
    data = encode(Image.open(io.BytesIO(jpeg(7, (700, 525)))), fmt)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=fitted(320))
    assert decoded.image.size == (700, 525)
    assert not decoded.jpeg


# ---------------------------------------------------------------- drafted ≈ full


CASES = [
    ("letterbox", 320, (640, 480)),  # the detector on the benchmark's photos: 1/2
    ("letterbox", 320, (1280, 960)),  # 1/4
    ("letterbox", 320, (480, 640)),  # portrait: 1/2
    ("crop", 224, (640, 480)),  # not drafted (480 < 2 × 256): the folded resize alone
    ("crop", 224, (1200, 900)),  # 1/2
    ("crop", 224, (2048, 1536)),  # 1/4
]


def prepare(how: str, decoded: Decoded, size: int) -> np.ndarray:
    return letterbox(decoded, size)[0] if how == "letterbox" else center_crop(decoded, size)


@pytest.mark.parametrize(("how", "size", "source"), CASES)
def test_a_drafted_photo_is_close_to_the_full_decode(
    how: str, size: int, source: tuple[int, int]
) -> None:
    data = jpeg(4, source)
    sizer = fitted(size) if how == "letterbox" else cropped(size)
    drafted = prepare(how, decode_image(data, max_pixels=MAX_PIXELS, draft_to=sizer), size)
    image = full_rgb(data)
    full = full_letterbox(image, size) if how == "letterbox" else full_crop(image, size)
    assert drafted.shape == full.shape == (size, size, 3)
    assert drafted.dtype == full.dtype == np.uint8
    assert mean_abs_diff(drafted, full) < 1.5  # of 255: the same picture
    # And as the engine sees it: the same layout, dtype and normalisation.
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    a = normalize(np, drafted[None], mean=mean, std=std)
    b = normalize(np, full[None], mean=mean, std=std)
    assert a.shape == b.shape == (1, 3, size, size)
    assert a.dtype == b.dtype == np.float32
    assert float(np.abs(a - b).mean()) < 0.03


@pytest.mark.parametrize("source", [(641, 481), (1001, 333), (333, 1001), (2000, 2000), (4001, 41)])
def test_a_drafted_letterbox_has_the_full_decodes_shape(source: tuple[int, int]) -> None:
    """Content size, padding and the scale that maps boxes back all come from the full size."""
    data = quick_jpeg(source)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=fitted(320))
    pixels, fit = letterbox(decoded, 320)
    full_pixels, full_fit = letterbox(decode_image(data, max_pixels=MAX_PIXELS), 320)
    assert fit == full_fit
    width, height = letterbox_size(*source, 320)
    assert pixels.shape == full_pixels.shape == (320, 320, 3)
    assert (pixels[height:] == 0).all() and (pixels[:, width:] == 0).all()
    assert pixels[:height, :width].any()


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grey_and_cmyk_jpegs_draft_and_stay_close(mode: str) -> None:
    data = encode(Image.open(io.BytesIO(jpeg(4, (1280, 960)))).convert(mode), "JPEG", quality=90)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=cropped(224))
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == (640, 480)  # 1/2: 480 ≥ 256 still
    crop = center_crop(decoded, 224)
    assert crop.shape == (224, 224, 3)
    assert mean_abs_diff(crop, full_crop(full_rgb(data), 224)) < 1.5


# ---------------------------------------------------------------- other formats: exactly as before


def exact_input(name: str) -> bytes:
    """700×525: a JPEG this size would be drafted for both the 320 fit and the 224 crop."""
    photo = Image.open(io.BytesIO(jpeg(7, (700, 525))))
    encoders = {
        "png": lambda: encode(photo, "PNG"),
        "webp": lambda: encode(photo, "WEBP", quality=80),
        "webp-lossless": lambda: encode(photo, "WEBP", lossless=True),
        "grey-png": lambda: encode(photo.convert("L"), "PNG"),
        "rgba-png": lambda: encode(photo.convert("RGBA"), "PNG"),
        "palette-gif": lambda: encode(photo.convert("P"), "GIF"),
        "cmyk-tiff": lambda: encode(photo.convert("CMYK"), "TIFF"),
        "rotated-png": lambda: with_orientation(photo, "PNG", 6),
        "mirrored-png": lambda: with_orientation(photo, "PNG", 2),
    }
    return encoders[name]()


@pytest.mark.parametrize(
    "name",
    ["png", "webp", "webp-lossless", "grey-png", "rgba-png", "palette-gif", "cmyk-tiff",
     "rotated-png", "mirrored-png"],
)  # fmt: skip
def test_other_formats_match_the_full_path_exactly(name: str) -> None:
    data = exact_input(name)
    reference = full_rgb(data)
    crop = center_crop(decode_image(data, max_pixels=MAX_PIXELS, draft_to=cropped(224)), 224)
    assert np.array_equal(crop, full_crop(reference, 224)), name
    pixels, _fit = letterbox(decode_image(data, max_pixels=MAX_PIXELS, draft_to=fitted(320)), 320)
    assert np.array_equal(pixels, full_letterbox(reference, 320)), name


@pytest.mark.parametrize("source", [(640, 480), (100, 60), (300, 1000)])  # down, up, portrait
def test_an_undrafted_jpeg_crop_is_within_a_level_or_two_of_the_full_path(
    source: tuple[int, int],
) -> None:
    """Only the square that is kept is resampled: the same filter, a float box, so a few
    pixels move by a level or two."""
    data = jpeg(4, source)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=cropped(224))
    assert decoded.image.size == source
    difference = np.abs(center_crop(decoded, 224).astype(int) - full_crop(full_rgb(data), 224))
    assert difference.max() <= 2
    assert (difference > 0).mean() < 0.05


def test_a_decoded_image_already_at_the_resize_is_only_cropped() -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 300, 3), np.uint8))
    for jpeg_source in (False, True):
        crop = center_crop(Decoded(image, 300, 256, jpeg_source), 224)
        assert np.array_equal(crop, np.asarray(image)[16:240, 38:262])
