"""What a video is to Kiln before any frame is decoded (kiln.app.video): its container told from
its first bytes, the job's sampling rate, the moments sampled, the limits, and frame keys."""

from __future__ import annotations

import io
import math
import struct
from pathlib import Path

import pytest
from PIL import Image

from kiln.app import video
from kiln.app.core.errors import InputError
from kiln.app.video import (
    VideoLimits,
    check_fps,
    container_of,
    frame_key,
    refusal,
    sample_count,
    sample_times,
    split_key,
)
from tests.videos import plain

LIMITS = VideoLimits(max_frames=100_000, max_duration_s=24 * 3600.0)


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny clip in each container Kiln reads, made here by FFmpeg's muxers."""
    folder = tmp_path_factory.mktemp("containers")
    return {suffix: plain(folder / f"clip.{suffix}", 3) for suffix in
            ("mp4", "mov", "mkv", "webm", "avi", "ts")}  # fmt: skip


def head(path: Path) -> bytes:
    return path.read_bytes()[: video.HEAD_BYTES]


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
    assert len(ts) >= 6 * video.TS_PACKET and ts[0] == 0x47
    m2ts = b"".join(
        struct.pack(">I", 1000 * n) + ts[i : i + video.TS_PACKET]
        for n, i in enumerate(range(0, 6 * video.TS_PACKET, video.TS_PACKET))
    )
    assert m2ts[4] == 0x47 and m2ts[196] == 0x47
    assert container_of(m2ts[: video.HEAD_BYTES]) == "mpegts"


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
    assert container_of(data[: video.HEAD_BYTES]) is None


@pytest.mark.parametrize(("value", "fps"), [(0, 0.0), (0.5, 0.5), ("2", 2.0), (1000, 1000.0)])
def test_video_fps_is_a_number_of_frames_per_second(value: object, fps: float) -> None:
    assert check_fps(value) == fps


@pytest.mark.parametrize(
    "value", [-1, "abc", True, False, math.nan, "nan", math.inf, 5000, None, [2]]
)
def test_a_bad_video_fps_is_refused_with_a_sentence(value: object) -> None:
    with pytest.raises(InputError, match=r"^video_fps must be .+\.$") as caught:
        check_fps(value)
    assert repr(value) in str(caught.value)


def test_the_sampled_moments() -> None:
    times = sample_times(30.0, 2.0)
    assert len(times) == sample_count(30.0, 2.0) == 60
    assert times[0] == 0.0 and times[1] == 0.5 and times[-1] == 29.5
    assert times == [k / 2 for k in range(60)]
    assert sample_count(3.0, 2.0) == 6  # one at each k/fps before the end, none at it
    assert sample_count(3.01, 2.0) == 7
    assert sample_count(0.3, 10.0) == 3  # 0.3 × 10 is 3.0000000000000004
    assert sample_count(0.04, 1.0) == 1  # a video shorter than one interval: its first frame
    assert sample_count(0.0, 1.0) == 1
    assert sample_times(10.0, 0.1) == [0.0]
    assert sample_times(3600.0, 1.0)[-1] == 3599.0


def test_a_video_over_the_duration_limit_is_refused() -> None:
    why = refusal(90_000.0, None, 1.0, LIMITS)
    assert why is not None
    assert "KILN_MAX_VIDEO_DURATION_S" in why and "90,000 s" in why and "86,400 s" in why
    assert why.endswith(".")
    # the duration is refused whatever the sampling, every frame included
    assert refusal(90_000.0, 10, 0.0, LIMITS) == why


def test_a_video_sampled_over_the_frame_limit_is_refused() -> None:
    why = refusal(3600.0, None, 30.0, LIMITS)
    assert why is not None
    assert "KILN_MAX_VIDEO_FRAMES" in why and "108,000 frames" in why and "100,000" in why
    assert "lower video_fps" in why and why.endswith(".")
    every = refusal(3600.0, 200_000, 0.0, LIMITS)
    assert every is not None and "every frame" in every and "200,000 frames" in every
    assert "KILN_MAX_VIDEO_FRAMES" in every


def test_a_rate_above_the_video_s_own_counts_its_frames_once() -> None:
    """Each frame is sampled at most once: 500 fps of a 10 fps clip is its frames, not 50 of
    each; a header that does not count its frames is judged by the moments."""
    limits = VideoLimits(max_frames=100, max_duration_s=3600.0)
    assert refusal(3.0, 30, 500.0, limits) is None  # 1,500 moments, 30 frames
    why = refusal(3.0, 101, 500.0, limits)
    assert why is not None and "gives 101 frames, over the 100 limit" in why
    assert refusal(3.0, None, 500.0, limits) is not None  # 1,500 moments
    assert refusal(3.0, None, 500.0, limits, sampled=30) is None  # a plan's exact count
    assert refusal(3.0, None, 500.0, limits, own_fps=10.0) is None  # the header's rate


def test_a_video_within_the_limits_is_taken() -> None:
    limits = VideoLimits(max_frames=60, max_duration_s=30.0)
    assert refusal(30.0, None, 2.0, limits) is None  # exactly at both limits
    assert refusal(30.0, 60, 0.0, limits) is None
    assert refusal(30.0, 61, 0.0, limits) is not None
    assert refusal(30.1, None, 2.0, limits) is not None
    assert refusal(29.9, None, 2.5, limits) is not None  # 75 frames
    assert refusal(None, None, 2.0, limits) is None  # a header that says nothing: the worker
    assert refusal(None, None, 0.0, limits) is None  # counts the packets


def test_frame_keys_round_trip() -> None:
    source = "store:jobs/j/inputs/000001"
    assert frame_key(source, 1.5) == "store:jobs/j/inputs/000001#t=1.500"
    assert split_key(frame_key(source, 1.5), 1.5) == source
    assert frame_key(source, 1 / 3) == f"{source}#t=0.333"
    assert split_key(frame_key(source, 1 / 3), 1 / 3) == source
    assert split_key(frame_key(source, 3599.0), 3599.0) == source
    assert split_key(source, None) == source  # not a frame: its own key
    assert split_key(f"{source}#t=2.000", 1.0) == f"{source}#t=2.000"  # not this frame's time


@pytest.mark.parametrize(
    "source",
    ["s3://bucket/odd#t=9.000.mp4", "s3://bucket/clip.mp4#t=2.000", "a#t=#t=#t=1.000"],
)
def test_a_key_that_holds_a_fragment_itself_round_trips(source: str) -> None:
    for t in (0.0, 2.0, 9.0):
        key = frame_key(source, t)
        assert key.startswith(source) and key.count("#t=") == source.count("#t=") + 1
        assert split_key(key, t) == source


def test_read_header_says_what_an_upload_header_claims(clips: dict[str, Path]) -> None:
    header = video.read_header(clips["mp4"].read_bytes())
    assert header is not None
    duration, frames, fps = header
    assert duration == pytest.approx(0.3, abs=0.01) and frames == 3 and fps == 10.0
    assert video.read_header(b"not a video at all") is None
