"""A video's container told from its first bytes, never its name (kiln.app.video.container),
and what an upload's header claims."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import pytest
from PIL import Image

from kiln.app.video.container import HEAD_BYTES, TS_PACKET, container_of, read_header
from tests.videos import plain


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny clip in each container Kiln reads, made here by FFmpeg's muxers."""
    folder = tmp_path_factory.mktemp("containers")
    return {suffix: plain(folder / f"clip.{suffix}", 3) for suffix in
            ("mp4", "mov", "mkv", "webm", "avi", "ts")}  # fmt: skip


def head(path: Path) -> bytes:
    return path.read_bytes()[:HEAD_BYTES]


@pytest.mark.parametrize(
    ("suffix", "container"),
    [
        ("mp4", "mp4"),
        ("mov", "mp4"),
        ("mkv", "matroska"),
        ("webm", "matroska"),
        ("avi", "avi"),
        ("ts", "mpegts"),
    ],
)
def test_containers_are_told_by_their_first_bytes(
    clips: dict[str, Path], suffix: str, container: str
) -> None:
    assert container_of(head(clips[suffix])) == container


def test_the_name_plays_no_part(clips: dict[str, Path], tmp_path: Path) -> None:
    misnamed = tmp_path / "holiday.jpg"
    misnamed.write_bytes(clips["mkv"].read_bytes())
    assert container_of(head(misnamed)) == "matroska"


def test_m2ts_packets_of_192_bytes_are_a_transport_stream(clips: dict[str, Path]) -> None:
    """Blu-ray's M2TS: each 188-byte TS packet behind a 4-byte timestamp."""
    ts = clips["ts"].read_bytes()
    assert len(ts) >= 6 * TS_PACKET and ts[0] == 0x47
    m2ts = b"".join(
        struct.pack(">I", 1000 * n) + ts[i : i + TS_PACKET]
        for n, i in enumerate(range(0, 6 * TS_PACKET, TS_PACKET))
    )
    assert m2ts[4] == 0x47 and m2ts[196] == 0x47
    assert container_of(m2ts[:HEAD_BYTES]) == "mpegts"


def test_other_headers_of_the_containers() -> None:
    assert container_of(b"\x00\x00\x00\x14ftypisom\x00\x00\x02\x00isom") == "mp4"
    assert container_of(b"\x00\x00\x00\x14ftyp3gp5\x00\x00\x00\x00" + b"3gp5") == "mp4"
    assert container_of(b"\x00\x00\x00\x08wide\x00\x10\x00\x00mdat") == "mp4"  # old QuickTime
    assert container_of(b"\x00\x00\x01\xba\x44\x00\x04\x00\x04\x01") == "mpeg"
    assert container_of(b"FLV\x01\x05\x00\x00\x00\x09\x00\x00\x00\x00") == "flv"


def image_bytes(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, fmt)
    return buffer.getvalue()


def ftyp(major: bytes, *compatible: bytes) -> bytes:
    body = major + b"\x00\x00\x00\x00" + b"".join(compatible)
    return struct.pack(">I", 8 + len(body)) + b"ftyp" + body + b"\x00\x00\x00\x08meta"


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(image_bytes("JPEG"), id="jpeg"),
        pytest.param(image_bytes("PNG"), id="png"),
        pytest.param(image_bytes("WEBP"), id="webp"),
        pytest.param(image_bytes("GIF"), id="gif"),
        pytest.param(image_bytes("TIFF"), id="tiff"),
        pytest.param(ftyp(b"heic", b"mif1", b"heic"), id="heic"),
        pytest.param(ftyp(b"heix", b"mif1", b"heix"), id="heix"),
        pytest.param(ftyp(b"mif1", b"mif1", b"heic"), id="heif-mif1"),
        pytest.param(ftyp(b"avif", b"mif1", b"avif"), id="avif"),
        pytest.param(b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00", id="wav"),
        pytest.param(b"ID3\x04\x00\x00\x00\x00\x00\x00", id="mp3"),
        pytest.param(b"a caption, in plain text\n", id="text"),
        pytest.param(b"I'm free to go; the wide road waits.\n", id="text-free"),
        pytest.param(b'{"caption": "a cat on a mat"}', id="json"),
        pytest.param(b"G" + b"x" * 600, id="one-ts-sync-byte"),
        pytest.param(b"", id="empty"),
    ],
)
def test_anything_else_is_no_video(data: bytes) -> None:
    assert container_of(data[:HEAD_BYTES]) is None


def test_read_header_says_what_an_upload_header_claims(clips: dict[str, Path]) -> None:
    header = read_header(clips["mp4"].read_bytes())
    assert header is not None
    duration, frames, fps = header
    assert duration == pytest.approx(0.3, abs=0.01) and frames == 3 and fps == 10.0
    assert read_header(b"not a video at all") is None
