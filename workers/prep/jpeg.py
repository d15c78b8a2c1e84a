"""A plain JPEG's header read without Pillow: what `read_header` (workers/device/pixels.py) says
of it — upright size, EXIF orientation, whether nvJPEG may decode it — at a fraction of the
cost (Pillow's open and EXIF parse are a third of a prep process's work per image on the
GPU-decode path).

It follows only what it can follow exactly: SOI, then APPn, COM, DQT, DHT, DRI and one
baseline, extended or progressive SOF, up to SOS; a well-formed EXIF IFD0 and XMP for the
orientation. Anything else — another marker, fill bytes, a segment Pillow would refuse or read
differently (MPO, Photoshop resources, a second EXIF segment, an odd orientation entry), an
image over a pixel cap — gives None, and Pillow reads the file as before, with its sentences.
"""

from __future__ import annotations

import re
import struct

from PIL import Image

from kiln.workers.prep.header import ROTATED, Header

_SOF = {0xC0, 0xC1, 0xC2}  # baseline, extended sequential, progressive (Huffman)
_SKIPPED = {0xC4, 0xDD, 0xFE}  # DHT, DRI, COM: Pillow reads their length only
_LAYERS = {1: True, 3: True, 4: False}  # components → whether nvJPEG decodes it (L, RGB; CMYK)
_ORIENTATION = 0x0112
_ZERO = -1  # an orientation entry that says 0
_TIFF_UNITS = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4}
_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')  # as Pillow's getexif


class _Segments:
    """What the walk up to SOS found."""

    def __init__(self) -> None:
        self.size: tuple[int, int] | None = None
        self.nvjpeg = False
        self.exif: bytes | None = None
        self.xmp: bytes | None = None
        self.icc: list[bytes] = []


def quick_header(data: bytes, max_pixels: int) -> Header | None:
    """The header `read_header` would give, or None where this reader is not sure (Pillow
    then reads the file, and says why it fails where it does)."""
    found = _walk(data)
    if found is None or found.size is None:
        return None
    width, height = found.size
    limit = min(max_pixels, Image.MAX_IMAGE_PIXELS or max_pixels)
    if width <= 0 or height <= 0 or width * height > limit:
        return None  # Pillow's refusal, or Kiln's cap, with their sentences
    orientation = _orientation(found)
    if orientation is None:
        return None
    if orientation in ROTATED:
        width, height = height, width
    return Header(width, height, orientation, found.nvjpeg and _complete(data))


def _walk(data: bytes) -> _Segments | None:
    """The segments from SOI to SOS, each as Pillow reads it; None at anything else."""
    end = len(data)
    if end < 4 or data[:3] != b"\xff\xd8\xff":
        return None
    found, pos = _Segments(), 2
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        stop = pos + 2 + ((data[pos + 2] << 8) | data[pos + 3])
        if stop < pos + 4 or stop > end:
            return None  # a length Pillow would read past the end (or under its own 2 bytes)
        if marker == 0xDA:
            return found if found.size is not None else None
        segment = data[pos + 4 : stop]
        if not _read(found, marker, segment):
            return None
        pos = stop
    return None


def _read(found: _Segments, marker: int, segment: bytes) -> bool:
    """Take one segment in; False where Pillow would refuse it or read it another way."""
    if 0xE0 <= marker <= 0xEF:
        return _app(found, marker, segment)
    if marker == 0xDB:
        return _dqt(segment)
    if marker in _SOF:
        return _sof(found, segment)
    return marker in _SKIPPED


def _app(found: _Segments, marker: int, s: bytes) -> bool:
    if marker == 0xE0 and s.startswith(b"JFIF"):
        return len(s) >= 7  # Pillow reads the version unguarded
    if marker == 0xE1 and s.startswith(b"Exif\0\0"):
        if found.exif is not None:
            return False  # Pillow joins a second one onto the first
        found.exif = s
    elif marker == 0xE1 and s.startswith(_XMP):
        found.xmp = s[len(_XMP) :]
    elif marker == 0xE2 and s.startswith(b"ICC_PROFILE\0"):
        found.icc.append(s)
    elif marker == 0xE2 and s.startswith(b"MPF\0"):
        return False  # a multi-picture file: Pillow opens it as MPO
    elif marker == 0xED and s.startswith(b"Photoshop 3.0\x00"):
        return False  # its resource blocks can stop Pillow's reader
    elif marker == 0xEE and s.startswith(b"Adobe"):
        return len(s) >= 7
    return True


def _dqt(s: bytes) -> bool:
    """Pillow's check of the quantisation tables: each whole."""
    while s:
        length = 1 + (64 if s[0] // 16 == 0 else 128)
        if len(s) < length:
            return False
        s = s[length:]
    return True


def _sof(found: _Segments, s: bytes) -> bool:
    if found.size is not None or len(s) < 6 or (len(s) - 6) % 3 or s[0] != 8:
        return False  # a second frame, a short one, or what Pillow cannot handle
    nvjpeg = _LAYERS.get(s[5])
    if nvjpeg is None:
        return False
    if found.icc and min(found.icc)[13:14] == b"":
        return False  # Pillow reads the first chunk's count unguarded
    found.size = ((s[3] << 8) | s[4], (s[1] << 8) | s[2])
    found.nvjpeg = nvjpeg
    found.icc = []
    return True


def _orientation(found: _Segments) -> int | None:
    """The EXIF orientation (1 where none), as `read_header` reads it; None where the EXIF is
    not plain enough to be sure."""
    value: int | None = 0
    if found.exif is not None:
        value = _exif_orientation(found.exif[6:])
        if value is None:
            return None
        if value == _ZERO:  # stated, as 0: Pillow's orientation is "there", XMP not asked
            return 1
    if not value and found.xmp:
        match = _XMP_ORIENTATION.search(found.xmp)
        if match:
            value = int(match[2])
    return value or 1


def _exif_orientation(tiff: bytes) -> int | None:
    """IFD0's orientation (0 where it has none, `_ZERO` where it says 0); None where any of
    IFD0 is out of bounds or odd (Pillow warns and skips, or fails: it decides)."""
    if len(tiff) < 8 or tiff.startswith(b"Exif\0\0"):
        return None
    order = {b"II*\0": "<", b"MM\0*": ">"}.get(tiff[:4])
    if order is None:
        return None
    (ifd,) = struct.unpack_from(order + "L", tiff, 4)
    if ifd + 2 > len(tiff):
        return None
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    if ifd + 2 + 12 * count + 4 > len(tiff):
        return None
    found = 0
    entry = struct.Struct(order + "HHL4s")
    for i in range(count):
        tag, kind, items, raw = entry.unpack_from(tiff, ifd + 2 + 12 * i)
        unit = _TIFF_UNITS.get(kind)
        if unit is None or items == 0:
            return None
        size = unit * items
        if size > 4 and struct.unpack(order + "L", raw)[0] + size > len(tiff):
            return None
        if tag == _ORIENTATION:
            if found or kind != 3 or items != 1:
                return None
            found = struct.unpack(order + "H", raw[:2])[0] or _ZERO
    return found


def _complete(data: bytes) -> bool:
    """Ends with EOI, trailing zeros aside (as `read_header`: nvJPEG fills a truncated JPEG
    with grey where Pillow refuses it)."""
    if data.endswith(b"\0"):
        data = data.rstrip(b"\0")
    return data.endswith(b"\xff\xd9")
