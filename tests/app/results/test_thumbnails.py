"""Thumbnails (app/results/thumbnails.py): small, upright JPEGs, never the original; a picture too
large to decode or no picture at all is a sentence."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from devstack.images import photo, solid
from kiln.app.core.errors import InputError
from kiln.app.results.thumbnails import THUMBNAIL_PX, thumbnail


def size_of(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "JPEG"
        return image.size


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_large_picture_shrinks_to_the_cap_keeping_its_shape(fmt: str) -> None:
    assert size_of(thumbnail(photo(1, (1600, 1200), fmt), 50_000_000)) == (THUMBNAIL_PX, 192)


def test_a_small_picture_is_not_enlarged() -> None:
    assert size_of(thumbnail(solid((10, 20, 30), (40, 30)), 50_000_000)) == (40, 30)


def test_the_camera_orientation_is_applied() -> None:
    image = Image.open(io.BytesIO(photo(2, (800, 400))))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°: stored landscape, shown portrait
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif)
    assert size_of(thumbnail(out.getvalue(), 50_000_000)) == (128, THUMBNAIL_PX)


def test_too_many_pixels_or_no_picture_is_a_sentence() -> None:
    with pytest.raises(InputError, match=r"The image is 800×600 pixels, more than Kiln decodes\."):
        thumbnail(photo(3, (800, 600)), 100_000)
    with pytest.raises(InputError, match=r"Item 'x' is not a picture Kiln can read\."):
        thumbnail(b"not a picture", 50_000_000, "Item 'x'")
    with pytest.raises(InputError, match="cannot be shown as a picture"):
        thumbnail(photo(4)[:600], 50_000_000)  # a JPEG cut short
