"""The JPEG header read without Pillow says what `read_header` says, or leaves the file to it:
on plain, rotated, grey, CMYK, progressive and damaged JPEGs, and on thousands of mutations of
their headers, `header_of` gives the same header or the same error as Pillow's reading."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image

from devstack.images import photo, truncated_jpeg
from kiln.app.core.errors import InputError
from kiln.workers.prep.header import Header, read_header
from kiln.workers.prep.images import header_of
from kiln.workers.prep.jpeg import quick_header

MAX_PIXELS = 50_000_000
XMP = b'http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><rdf:Description tiff:Orientation="8"/>'


def jpeg(size: tuple[int, int] = (64, 48), mode: str = "RGB", **options: object) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 128 if mode == "L" else (10, 200, 30, 0)[: len(mode)]).save(
        out, "JPEG", **options
    )
    return out.getvalue()


def oriented(orientation: int, big_endian: bool = False) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x011A] = 72.0
    exif[0x0128] = 2
    return jpeg((60, 40), exif=exif.tobytes() if not big_endian else _big(exif.tobytes()))


def _big(exif: bytes) -> bytes:
    """The same one-entry-per-tag EXIF, in Motorola order."""
    image = Image.open(io.BytesIO(jpeg(exif=exif)))
    parsed = image.getexif()
    parsed.endian = ">"
    return parsed.tobytes()


def with_segment(data: bytes, marker: int, body: bytes) -> bytes:
    """`data` with one more segment right after SOI."""
    return data[:2] + bytes([0xFF, marker]) + (len(body) + 2).to_bytes(2, "big") + body + data[2:]


def corpus() -> dict[str, bytes]:
    return {
        "photo": photo(1),
        "grey": jpeg(mode="L"),
        "cmyk": jpeg(mode="CMYK"),
        "progressive": jpeg(progressive=True),
        "optimised": jpeg(optimize=True, quality=40),
        "no-jfif": jpeg()[:2] + jpeg()[20:],
        "truncated": truncated_jpeg(2),
        "zeros": jpeg() + b"\0" * 9,
        "comment": jpeg(comment=b"hello"),
        "icc": jpeg(icc_profile=b"\0" * 300),
        "xmp": with_segment(jpeg(), 0xE1, XMP),
        "xmp-and-exif": with_segment(oriented(3), 0xE1, XMP),
        "restart": jpeg(restart_marker_blocks=1),
        "big": jpeg((4000, 3000)),
        **{f"orientation-{o}": oriented(o) for o in range(0, 10)},
        "motorola": oriented(6, big_endian=True),
        "adobe": with_segment(jpeg(), 0xEE, b"Adobe\0\x64\0\0\0\0\1"),
        "short-adobe": with_segment(jpeg(), 0xEE, b"Adobe"),
        "short-jfif": with_segment(jpeg()[:2] + jpeg()[20:], 0xE0, b"JFIF"),
        "photoshop": with_segment(jpeg(), 0xED, b"Photoshop 3.0\x008BIM\x04\x04"),
        "mpf": with_segment(jpeg(), 0xE2, b"MPF\0II*\0"),
        "two-exif": with_segment(oriented(6), 0xE1, b"Exif\0\0II*\0\x08\0\0\0\0\0"),
        "empty": b"",
        "png": photo(2, fmt="PNG"),
        "text": b"\xff\xd8\xff but not really a JPEG at all",
    }


def outcome(read: object, data: bytes, max_pixels: int = MAX_PIXELS) -> object:
    try:
        return read(data, max_pixels=max_pixels)  # type: ignore[operator]
    except Exception as error:  # the same error, type and sentence
        return type(error), str(error)


@pytest.mark.parametrize("name", sorted(corpus()))
def test_the_quick_header_agrees_with_pillow(name: str) -> None:
    data = corpus()[name]
    assert outcome(header_of, data) == outcome(read_header, data)


def test_plain_jpegs_are_read_without_pillow() -> None:
    files = corpus()
    for name in ["photo", "grey", "progressive", "optimised", "comment", "icc", "xmp", "big"]:
        assert quick_header(files[name], MAX_PIXELS) is not None, name
    assert quick_header(files["orientation-6"], MAX_PIXELS) == Header(40, 60, 6, True)
    assert quick_header(files["motorola"], MAX_PIXELS) == Header(40, 60, 6, True)
    assert quick_header(files["xmp"], MAX_PIXELS) == Header(48, 64, 8, True)
    assert quick_header(files["cmyk"], MAX_PIXELS) == Header(64, 48, 1, False)
    assert quick_header(files["truncated"], MAX_PIXELS) == Header(640, 480, 1, False)


def test_what_pillow_must_judge_is_left_to_it() -> None:
    files = corpus()
    for name in ["photoshop", "mpf", "two-exif", "short-adobe", "short-jfif", "empty", "png"]:
        assert quick_header(files[name], MAX_PIXELS) is None, name
    assert quick_header(files["big"], 1000) is None  # over the cap: Kiln's sentence
    with pytest.raises(InputError, match="over the limit of 1,000 pixels"):
        header_of(files["big"], max_pixels=1000)


def test_damaged_headers_read_as_pillow_reads_them() -> None:
    """Bytes flipped, zeroed or cut anywhere in the headers of every kind of JPEG above."""
    rng = random.Random(38)
    files = [d for d in corpus().values() if d.startswith(b"\xff\xd8")]
    agreed = quick = 0
    for _ in range(3000):
        data = bytearray(rng.choice(files))
        head = min(len(data), 700)
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            at = rng.randrange(2, head)
            if kind < 0.5:
                data[at] = rng.randrange(256)
            elif kind < 0.8:
                data[at] = rng.choice([0, 0xFF, 0xD9, 0xDA, 0xC0, 0xE1])
            else:
                del data[at:]
                head = len(data)
                if head <= 2:
                    break
        mutated = bytes(data)
        assert outcome(header_of, mutated) == outcome(read_header, mutated), mutated[:64]
        agreed += 1
        quick += quick_header(mutated, MAX_PIXELS) is not None
    assert agreed == 3000 and quick > 300  # many were read quickly, and all agreed
