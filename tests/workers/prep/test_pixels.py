"""Decode, letterbox, centre crop and the batch-wide `normalize`."""

from __future__ import annotations

import io
import random
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageDraw

from kiln.app.catalog.model_spec import Preprocessing
from kiln.app.core.errors import InputError
from kiln.workers.prep.pixels import (
    Decoded,
    Letterbox,
    Squash,
    center_crop,
    decode_image,
    fit_image,
    fit_size,
    letterbox,
    normalize,
    squash,
    stack,
)

MAX_PIXELS = 50_000_000


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def picture(size: tuple[int, int] = (320, 240), seed: int = 0) -> Image.Image:
    rng = random.Random(seed)
    image = Image.new("RGB", size, (40, 90, 160))
    draw = ImageDraw.Draw(image)
    for _ in range(10):
        x0, y0 = rng.randrange(size[0] - 8), rng.randrange(size[1] - 8)
        x1, y1 = rng.randint(x0 + 4, size[0]), rng.randint(y0 + 4, size[1])
        draw.rectangle([x0, y0, x1, y1], fill=tuple(rng.randrange(256) for _ in range(3)))
    return image


def with_orientation(image: Image.Image, orientation: int) -> bytes:
    exif = image.getexif()
    exif[0x0112] = orientation
    return encode(image, "JPEG", exif=exif)


# ---------------------------------------------------------------- decode_image


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_decode_common_formats(fmt: str) -> None:
    decoded = decode_image(encode(picture((64, 48)), fmt), max_pixels=MAX_PIXELS)
    assert isinstance(decoded, Decoded)
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == (64, 48)
    assert (decoded.width, decoded.height) == (64, 48)


def test_decode_png_pixels_are_exact() -> None:
    source = picture((40, 30))
    decoded = decode_image(encode(source, "PNG"), max_pixels=MAX_PIXELS)
    assert np.array_equal(np.asarray(decoded.image), np.asarray(source))


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "CMYK", "1"])
def test_decode_converts_other_modes_to_rgb(mode: str) -> None:
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    data = encode(picture((32, 16)).convert(mode), fmt)
    decoded = decode_image(data, max_pixels=MAX_PIXELS)
    assert decoded.image.mode == "RGB"
    assert decoded.image.size == (32, 16)


def test_empty_file() -> None:
    with pytest.raises(InputError, match="empty"):
        decode_image(b"", max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("seed", range(5))
def test_random_bytes_are_not_an_image(seed: int) -> None:
    data = random.Random(seed).randbytes(500)
    with pytest.raises(InputError, match="neither an image nor a video"):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_text_is_not_an_image() -> None:
    with pytest.raises(InputError):
        decode_image(b"hello, I am a text file\n" * 10, max_pixels=MAX_PIXELS)


def test_image_over_the_pixel_limit() -> None:
    data = encode(picture((100, 100)), "PNG")
    with pytest.raises(InputError, match="over the limit of 9,999 pixels") as info:
        decode_image(data, max_pixels=9_999)
    assert "100×100" in str(info.value)
    assert decode_image(data, max_pixels=10_000).width == 100  # exactly at the limit is fine


def png_header_only(width: int, height: int) -> bytes:
    """A PNG claiming `width`×`height` in its IHDR chunk, with an empty IDAT chunk."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        body = kind + payload
        return struct.pack(">I", len(payload)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"")


def test_pixel_limit_is_checked_before_decoding() -> None:
    """A decompression bomb is refused from its header, without decoding its pixels."""
    data = png_header_only(20_000, 20_000)
    # Beyond twice Pillow's own limit its header check fires first; either way, a sentence.
    with pytest.raises(InputError, match="too large to decode safely"):
        decode_image(data, max_pixels=MAX_PIXELS)
    data = png_header_only(9_000, 9_000)
    with pytest.raises(InputError, match="9000×9000 pixels, over the limit"):
        decode_image(data, max_pixels=MAX_PIXELS)


@pytest.mark.parametrize(
    ("data", "claimed"),
    [
        (png_header_only(60_000, 60_000), "3,600,000,000"),
        (png_header_only(20_000, 10_000), "200,000,000"),
    ],
)
def test_headers_far_over_the_limit_name_both_numbers(data: bytes, claimed: str) -> None:
    """Refused by Pillow before Kiln sees the size: still Kiln's sentence, with Kiln's limit."""
    with pytest.raises(InputError) as info:
        decode_image(data, max_pixels=MAX_PIXELS)
    assert str(info.value) == (
        f"The image is too large to decode safely: it claims {claimed} pixels "
        "and the limit is 50,000,000."
    )


def test_gif_header_over_the_limit() -> None:
    data = bytearray(encode(Image.new("P", (1, 1)), "GIF"))
    data[6:10] = struct.pack("<HH", 30_000, 30_000)  # the logical screen
    with pytest.raises(InputError, match="claims 900,000,000 pixels"):
        decode_image(bytes(data), max_pixels=MAX_PIXELS)


LEVELS_16 = np.array([[0, 100 * 257, 200 * 257, 65535]], dtype=np.uint16)


@pytest.mark.parametrize(
    ("image", "fmt"),
    [
        (Image.fromarray(LEVELS_16), "PNG"),  # opens as I;16
        (Image.fromarray(LEVELS_16), "TIFF"),
        (Image.frombytes("I;16B", (4, 1), LEVELS_16.astype(">u2").tobytes()), "TIFF"),
        (Image.fromarray(LEVELS_16.astype(np.int32)), "TIFF"),  # opens as I (32-bit)
    ],
)
def test_16_bit_grey_keeps_its_levels(image: Image.Image, fmt: str) -> None:
    """Pillow's own conversion clips 16-bit grey at 255 (a white picture); Kiln scales it."""
    decoded = decode_image(encode(image, fmt), max_pixels=MAX_PIXELS)
    pixels = np.asarray(decoded.image)
    assert decoded.image.mode == "RGB"
    assert pixels[0, :, 0].tolist() == [0, 100, 200, 255]
    assert (pixels[..., 0] == pixels[..., 2]).all()


def test_animated_gif_decodes_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)
    pixels = np.asarray(decode_image(data, max_pixels=MAX_PIXELS).image)
    assert (pixels == (255, 0, 0)).all()


@pytest.mark.parametrize("fraction", [0.33, 0.6, 0.95])
def test_truncated_jpeg_body(fraction: float) -> None:
    data = encode(picture((320, 240)), "JPEG", quality=90)
    with pytest.raises(InputError, match="could not be decoded"):
        decode_image(data[: int(len(data) * fraction)], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("length", [3, 20, 60, 150])
def test_jpeg_truncated_inside_its_header(length: int) -> None:
    """Cut inside the markers before the scan: still a clean `InputError`, not `OSError`."""
    data = encode(picture((320, 240)), "JPEG", quality=90)
    with pytest.raises(InputError):
        decode_image(data[:length], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_png(fraction: float) -> None:
    data = encode(picture((320, 240)), "PNG")
    with pytest.raises(InputError):
        decode_image(data[: int(len(data) * fraction)], max_pixels=MAX_PIXELS)


@pytest.mark.parametrize("orientation", [5, 6, 7, 8])
def test_exif_rotation_swaps_width_and_height(orientation: int) -> None:
    data = with_orientation(picture((60, 40)), orientation)
    decoded = decode_image(data, max_pixels=MAX_PIXELS)
    assert (decoded.width, decoded.height) == (40, 60)
    assert decoded.image.size == (40, 60)


@pytest.mark.parametrize("orientation", [1, 2, 3, 4])
def test_exif_orientation_without_rotation_keeps_size(orientation: int) -> None:
    data = with_orientation(picture((60, 40)), orientation)
    decoded = decode_image(data, max_pixels=MAX_PIXELS)
    assert (decoded.width, decoded.height) == (60, 40)
    assert decoded.image.size == (60, 40)


def test_exif_orientation_6_turns_the_picture_upright() -> None:
    # Left half white, right half black; orientation 6 means "rotate 90° clockwise to view":
    # the white half ends up on top.
    image = Image.new("RGB", (80, 40), (0, 0, 0))
    image.paste((255, 255, 255), (0, 0, 40, 40))
    decoded = decode_image(with_orientation(image, 6), max_pixels=MAX_PIXELS)
    pixels = np.asarray(decoded.image).astype(int)
    assert pixels[:40].mean() > 200
    assert pixels[40:].mean() < 50


def test_draft_decodes_smaller_but_reports_the_full_size() -> None:
    data = encode(picture((800, 600)), "JPEG")
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=100)
    assert (decoded.width, decoded.height) == (800, 600)
    assert decoded.image.width < 800
    assert decoded.image.width >= 100 and decoded.image.height >= 100
    assert decoded.image.width * 600 == decoded.image.height * 800  # same aspect


def test_draft_with_exif_rotation() -> None:
    data = with_orientation(picture((800, 600)), 6)
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=100)
    assert (decoded.width, decoded.height) == (600, 800)
    assert decoded.image.width < decoded.image.height
    assert decoded.image.height < 800


def test_draft_is_ignored_for_png() -> None:
    decoded = decode_image(encode(picture((400, 300)), "PNG"), max_pixels=MAX_PIXELS, draft_to=50)
    assert decoded.image.size == (400, 300)
    assert (decoded.width, decoded.height) == (400, 300)


# ---------------------------------------------------------------- letterbox


def solid_decoded(size: tuple[int, int], colour=(255, 255, 255)) -> Decoded:
    return Decoded(Image.new("RGB", size, colour), *size)


def test_letterbox_wide_image_pads_the_bottom() -> None:
    pixels, fit = letterbox(solid_decoded((200, 100)), 64)
    assert pixels.shape == (64, 64, 3)
    assert pixels.dtype == np.uint8
    assert fit == Letterbox(scale=64 / 200, width=200, height=100)
    assert (pixels[:32] == 255).all()
    assert (pixels[32:] == 0).all()


def test_letterbox_tall_image_pads_the_right() -> None:
    pixels, fit = letterbox(solid_decoded((50, 200)), 80)
    assert pixels.shape == (80, 80, 3)
    assert fit.scale == pytest.approx(80 / 200)
    assert (fit.width, fit.height) == (50, 200)
    assert (pixels[:, :20] == 255).all()
    assert (pixels[:, 20:] == 0).all()


def test_letterbox_upscales_small_images() -> None:
    pixels, fit = letterbox(solid_decoded((16, 8), (10, 20, 30)), 64)
    assert fit.scale == pytest.approx(4.0)
    assert (pixels[:32] == (10, 20, 30)).all()
    assert (pixels[32:] == 0).all()


def test_letterbox_square_fills_the_canvas() -> None:
    pixels, fit = letterbox(solid_decoded((100, 100), (1, 2, 3)), 50)
    assert fit.scale == pytest.approx(0.5)
    assert (pixels == (1, 2, 3)).all()


def test_letterbox_scale_uses_the_full_size_of_a_drafted_image() -> None:
    data = encode(Image.new("RGB", (800, 600), (255, 255, 255)), "JPEG")
    decoded = decode_image(data, max_pixels=MAX_PIXELS, draft_to=64)
    assert decoded.image.width < 800
    pixels, fit = letterbox(decoded, 64)
    assert fit == Letterbox(scale=64 / 800, width=800, height=600)
    assert (pixels[:48] > 240).all()
    assert (pixels[48:] == 0).all()


def test_letterbox_keeps_a_thin_image_at_least_one_pixel() -> None:
    pixels, fit = letterbox(solid_decoded((1000, 1)), 32)
    assert fit.scale == pytest.approx(32 / 1000)
    assert pixels.shape == (32, 32, 3)
    assert (pixels[0] == 255).all()
    assert (pixels[1:] == 0).all()


# ---------------------------------------------------------------- center_crop


@pytest.mark.parametrize("size", [(300, 200), (200, 300), (10, 10), (224, 224), (1000, 50)])
def test_center_crop_shape(size: tuple[int, int]) -> None:
    crop = center_crop(solid_decoded(size), 32)
    assert crop.shape == (32, 32, 3)
    assert crop.dtype == np.uint8


def test_center_crop_takes_the_middle() -> None:
    image = Image.new("RGB", (300, 100), (255, 0, 0))
    image.paste((0, 255, 0), (100, 0, 200, 100))
    crop = center_crop(Decoded(image, 300, 100), 32, crop_ratio=1.0)
    green = np.array([0, 255, 0])
    # The outermost columns may blend with the red neighbours when resampling.
    assert np.abs(crop[:, 1:-1].astype(int) - green).max() <= 8


def test_center_crop_ratio_resizes_the_short_side_first() -> None:
    # Short side → 32/0.5 = 64, the centre 32×32 of a 64×64 square: only the inner square.
    image = Image.new("RGB", (100, 100), (0, 0, 0))
    image.paste((255, 255, 255), (25, 25, 75, 75))
    crop = center_crop(Decoded(image, 100, 100), 32, crop_ratio=0.5)
    assert (crop[2:-2, 2:-2] > 240).all()


@pytest.mark.parametrize("resample", [Image.Resampling.BICUBIC, Image.Resampling.LANCZOS])
def test_center_crop_with_another_filter_is_pillows(resample: Image.Resampling) -> None:
    image = picture((300, 200), seed=3)
    crop = center_crop(Decoded(image, 300, 200), 64, crop_ratio=0.8, resample=resample)
    # Short side 200 → 80, long 300 → 120: the centre 64 of 120×80.
    reference = image.resize((120, 80), resample).crop((28, 8, 92, 72))
    assert np.array_equal(crop, np.asarray(reference))


# ---------------------------------------------------------------- squash and fit


def test_squash_stretches_to_the_square_and_maps_back_per_axis() -> None:
    image = picture((200, 50), seed=4)
    pixels, placed = squash(Decoded(image, 200, 50), 40, Image.Resampling.BICUBIC)
    assert np.array_equal(pixels, np.asarray(image.resize((40, 40), Image.Resampling.BICUBIC)))
    assert placed == Squash(scale_x=0.2, scale_y=0.8, width=200, height=50)
    assert placed.scales == (0.2, 0.8)
    assert Letterbox(0.5, 10, 10).scales == (0.5, 0.5)


@pytest.mark.parametrize(
    ("fit", "resized"), [("crop", (146, 73)), ("letterbox", (64, 32)), ("squash", (64, 64))]
)
def test_fit_size_is_what_each_fit_resizes_to(fit: str, resized: tuple[int, int]) -> None:
    """What a JPEG may be drafted to: a 400×200 image for a 64 input (crop: 64/0.875 = 73)."""
    pre = Preprocessing(input_size=64, fit=fit)  # type: ignore[arg-type]
    assert fit_size(pre, 400, 200) == resized


def test_fit_image_uses_the_declared_fit_and_filter() -> None:
    image = picture((120, 90), seed=5)
    decoded = Decoded(image, 120, 90)
    cropped, nothing = fit_image(decoded, Preprocessing(32, "crop", "nearest", crop_ratio=1.0))
    assert nothing is None
    assert np.array_equal(cropped, center_crop(decoded, 32, 1.0, Image.Resampling.NEAREST))
    boxed, placed = fit_image(decoded, Preprocessing(32, "letterbox", "bicubic"))
    assert placed == Letterbox(32 / 120, 120, 90)
    expected = np.asarray(image.resize((32, 24), Image.Resampling.BICUBIC))
    assert np.array_equal(boxed[:24], expected) and (boxed[24:] == 0).all()


# ---------------------------------------------------------------- normalize


MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def reference_nchw(batch: np.ndarray, mean, std, scale: float) -> np.ndarray:
    n, h, w, _ = batch.shape
    out = np.empty((n, 3, h, w), dtype=np.float64)
    for c in range(3):
        out[:, c] = (batch[..., c].astype(np.float64) * scale - mean[c]) / std[c]
    return out


@pytest.fixture
def batch() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(3, 5, 7, 3), dtype=np.uint8)


def test_normalize_nchw_float32(batch: np.ndarray) -> None:
    out = normalize(np, batch, mean=MEAN, std=STD)
    assert out.shape == (3, 3, 5, 7)
    assert out.dtype == np.float32
    assert out.flags.c_contiguous
    np.testing.assert_allclose(out, reference_nchw(batch, MEAN, STD, 1 / 255), rtol=1e-5, atol=1e-5)


def test_normalize_nhwc(batch: np.ndarray) -> None:
    out = normalize(np, batch, mean=MEAN, std=STD, layout="NHWC")
    assert out.shape == batch.shape
    assert out.dtype == np.float32
    assert out.flags.c_contiguous
    expected = reference_nchw(batch, MEAN, STD, 1 / 255).transpose(0, 2, 3, 1)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_normalize_float16(batch: np.ndarray) -> None:
    out = normalize(np, batch, mean=MEAN, std=STD, dtype="float16")
    assert out.dtype == np.float16
    assert out.flags.c_contiguous
    np.testing.assert_allclose(
        out.astype(np.float64), reference_nchw(batch, MEAN, STD, 1 / 255), rtol=2e-3, atol=2e-3
    )


def test_normalize_defaults_scale_to_unit_range(batch: np.ndarray) -> None:
    out = normalize(np, batch)
    np.testing.assert_allclose(out, batch.transpose(0, 3, 1, 2) / 255.0, rtol=1e-6, atol=1e-6)
    assert out.min() >= 0.0 and out.max() <= 1.0


def test_normalize_custom_scale(batch: np.ndarray) -> None:
    out = normalize(np, batch, mean=(127.5,) * 3, std=(127.5,) * 3, scale=1.0, layout="NHWC")
    np.testing.assert_allclose(out, batch / 127.5 - 1.0, rtol=1e-6, atol=1e-6)


def test_normalize_bgr_reverses_the_channels(batch: np.ndarray) -> None:
    """The pixels go in reversed; mean and std are already in the model's (BGR) order."""
    out = normalize(np, batch, mean=MEAN[::-1], std=STD[::-1], channel_order="BGR")
    expected = reference_nchw(batch[..., ::-1], MEAN[::-1], STD[::-1], 1 / 255)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert out.flags.c_contiguous
    rgb = normalize(np, batch, mean=MEAN, std=STD)
    np.testing.assert_allclose(out, rgb[:, ::-1], rtol=1e-5, atol=1e-5)


def test_normalize_rejects_unknown_channel_orders(batch: np.ndarray) -> None:
    with pytest.raises(ValueError, match="Unknown channel order 'GBR'"):
        normalize(np, batch, channel_order="GBR")


def test_normalize_does_not_modify_its_input(batch: np.ndarray) -> None:
    before = batch.copy()
    normalize(np, batch, mean=MEAN, std=STD)
    assert np.array_equal(batch, before)


@pytest.mark.parametrize(
    "shape", [(5, 7, 3), (1, 5, 7, 4), (1, 3, 5, 7), (1, 5, 7, 1), (2, 1, 5, 7, 3)]
)
def test_normalize_rejects_bad_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="NHWC batch with 3 channels"):
        normalize(np, np.zeros(shape, dtype=np.uint8))


def test_normalize_rejects_unknown_layouts(batch: np.ndarray) -> None:
    with pytest.raises(ValueError, match="Unknown layout 'CHW'"):
        normalize(np, batch, layout="CHW")


def test_stack() -> None:
    rows = [np.full((4, 4, 3), i, dtype=np.uint8) for i in range(3)]
    stacked = stack(rows)
    assert stacked.shape == (3, 4, 4, 3)
    assert stacked[2, 0, 0, 0] == 2
    empty = stack([])
    assert empty.shape[0] == 0 and empty.dtype == np.uint8
