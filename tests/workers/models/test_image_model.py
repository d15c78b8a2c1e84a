"""Declared preprocessing, seen through a real engine: an identity model returns exactly what a
registered image model is fed, compared with a reference computed here with Pillow."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devstack.images import photo
from kiln.app.catalog.model_spec import IMAGENET_MEAN, IMAGENET_STD, ImageModelSpec
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.classify import ClassifyPredictor
from kiln.workers.prep.pixels import center_crop, decode_image
from tests.workers.models.halves import batch, prep_of, prepare
from tests.workers.models.yolo import identity_model

SIZE = 16
MAX_PIXELS = 10_000_000
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def known_png(size: tuple[int, int] = (40, 30)) -> bytes:
    """Random pixels: every filter gives a different answer on them."""
    pixels = np.random.default_rng(7).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def fed(tmp_path: Path, stored: dict[str, Any], images: list[bytes]) -> np.ndarray:
    """What the engine receives for `images` under the stored spec `stored`."""
    layout = str(stored.get("layout", "NCHW"))
    path = identity_model(tmp_path / f"identity-{layout}.onnx", layout=layout, size=SIZE)
    engine = OnnxRuntimeEngine(path, max_batch=8)
    pipe = ClassifyPredictor("identity", engine, stored, max_pixels=MAX_PIXELS)
    output, failed = pipe._output(batch(pipe, images))
    assert not failed
    return output


def declared(**fields: Any) -> dict[str, Any]:
    return ImageModelSpec(input_size=SIZE, labels=["x"], **fields).stored("classify")


def clip_reference(data: bytes, resample: Image.Resampling) -> np.ndarray:
    """CLIP's steps by hand: short side to 16, centre 16×16, (x/255 − mean) / std, CHW."""
    image = Image.open(io.BytesIO(data)).convert("RGB")  # 40×30
    resized = image.resize((21, 16), resample)  # 40 × 16/30 = 21.3
    crop = np.asarray(resized.crop((2, 0, 18, 16)), dtype=np.float32)
    normalised = (crop / 255 - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)
    return normalised.transpose(2, 0, 1)


@pytest.mark.parametrize(
    ("name", "resample"),
    [
        ("bicubic", Image.Resampling.BICUBIC),
        ("lanczos", Image.Resampling.LANCZOS),
        ("nearest", Image.Resampling.NEAREST),
    ],
)
def test_a_clip_style_crop_is_pillows_resize_then_crop(
    tmp_path: Path, name: str, resample: Image.Resampling
) -> None:
    spec = declared(resize_filter=name, crop_ratio=1.0, mean=CLIP_MEAN, std=CLIP_STD)
    (ours,) = fed(tmp_path, spec, [known_png()])
    np.testing.assert_allclose(ours, clip_reference(known_png(), resample), atol=1e-5)
    other = Image.Resampling.BILINEAR
    assert np.abs(ours - clip_reference(known_png(), other)).max() > 0.1  # the filter counts


def test_bgr_swaps_the_channels(tmp_path: Path) -> None:
    rgb = declared(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    bgr = declared(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), channel_order="BGR")
    (as_rgb,) = fed(tmp_path, rgb, [known_png()])
    (as_bgr,) = fed(tmp_path, bgr, [known_png()])
    np.testing.assert_array_equal(as_bgr, as_rgb[::-1])


def test_bgr_means_are_given_in_bgr_order(tmp_path: Path) -> None:
    bgr = declared(mean=IMAGENET_MEAN[::-1], std=IMAGENET_STD[::-1], channel_order="BGR")
    (as_bgr,) = fed(tmp_path, bgr, [known_png()])
    (as_rgb,) = fed(tmp_path, declared(), [known_png()])
    np.testing.assert_allclose(as_bgr, as_rgb[::-1], atol=1e-6)


def test_nhwc_is_the_same_pixels_channels_last(tmp_path: Path) -> None:
    (nchw,) = fed(tmp_path, declared(resize_filter="bicubic"), [known_png()])
    (nhwc,) = fed(tmp_path, declared(resize_filter="bicubic", layout="NHWC"), [known_png()])
    assert nhwc.shape == (SIZE, SIZE, 3)
    np.testing.assert_array_equal(nhwc, nchw.transpose(1, 2, 0))


def test_a_0_255_range_with_its_mean_and_std_is_the_same_input(tmp_path: Path) -> None:
    wide = declared(
        pixel_range="0-255",
        mean=tuple(m * 255 for m in IMAGENET_MEAN),
        std=tuple(s * 255 for s in IMAGENET_STD),
    )
    (ours,) = fed(tmp_path, wide, [known_png()])
    (unit,) = fed(tmp_path, declared(), [known_png()])
    np.testing.assert_allclose(ours, unit, atol=1e-4)
    (raw,) = fed(tmp_path, declared(pixel_range="0-255", mean=(0, 0, 0), std=(1, 1, 1)), [
        known_png()
    ])  # fmt: skip
    assert raw.max() > 200 and float(raw.max()).is_integer()


def test_squash_and_letterbox_are_pillows_resize(tmp_path: Path) -> None:
    image = Image.open(io.BytesIO(known_png())).convert("RGB")  # 40×30
    plain = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "pixel_range": "0-255"}
    (squashed,) = fed(tmp_path, declared(fit="squash", resize_filter="bicubic", **plain), [
        known_png()
    ])  # fmt: skip
    expected = np.asarray(image.resize((SIZE, SIZE), Image.Resampling.BICUBIC), np.float32)
    np.testing.assert_array_equal(squashed.transpose(1, 2, 0), expected)
    (boxed,) = fed(tmp_path, declared(fit="letterbox", resize_filter="lanczos", **plain), [
        known_png()
    ])  # fmt: skip
    fitted = np.asarray(image.resize((16, 12), Image.Resampling.LANCZOS), np.float32)
    np.testing.assert_array_equal(boxed.transpose(1, 2, 0)[:12], fitted)
    assert (boxed[:, 12:] == 0).all()  # padded at the bottom


def test_a_spec_stored_before_these_fields_feeds_as_before(tmp_path: Path) -> None:
    """The keys every spec had before declared preprocessing: bilinear, 0.875, RGB, 0–1."""
    old = {"input_size": SIZE, "labels": ["x"], "mean": list(IMAGENET_MEAN),
           "std": list(IMAGENET_STD), "layout": "NCHW", "top_k": 5, "max_batch": None,
           "fp16": False, "description": ""}  # fmt: skip
    data = known_png((50, 37))
    (ours,) = fed(tmp_path, old, [data])
    crop = center_crop(decode_image(data, max_pixels=MAX_PIXELS), SIZE).astype(np.float32)
    expected = ((crop / 255 - np.float32(IMAGENET_MEAN)) / np.float32(IMAGENET_STD)).transpose(
        2, 0, 1
    )
    np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_a_bicubic_jpeg_is_still_drafted(tmp_path: Path) -> None:
    """A 1024×768 JPEG for a 16 px bicubic crop decodes at 1/8 scale, close to a full decode."""
    data = photo(5, size=(1024, 768))
    engine = OnnxRuntimeEngine(identity_model(tmp_path / "i.onnx", size=SIZE), max_batch=8)
    pipe = ClassifyPredictor(
        "identity", engine, declared(resize_filter="bicubic", crop_ratio=1.0), max_pixels=MAX_PIXELS
    )
    sizer = prep_of(pipe.prep)._sizer  # type: ignore[attr-defined]  # what prep drafts to
    drafted = decode_image(data, max_pixels=MAX_PIXELS, draft_to=sizer)
    assert drafted.image.size == (128, 96)
    full = Image.open(io.BytesIO(data)).convert("RGB").resize((21, 16), Image.Resampling.BICUBIC)
    reference = np.asarray(full.crop((2, 0, 18, 16)), dtype=np.float32)
    slot = prepare(pipe, data).slot
    assert slot is not None
    ours = slot.astype(np.float32)
    assert ours.shape == (SIZE, SIZE, 3)
    assert np.abs(ours - reference).mean() < 6.0  # of 255: the same picture
