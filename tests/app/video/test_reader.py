"""A video's index and its reader (kiln.app.video.index, kiln.app.video.reader): every frame and
keyframe from the packets, and frames by presentation time — decoding on when sampling is dense,
seeking to the keyframe when it is sparse, back and forth in any container. (The corrupt-frame rule
is tested through its users: the prep processes' plan of a damaged video,
tests/workers/prep/test_video.py, and the API's thumbnails,
tests/app/results/test_frame_thumbnails.py.)

`plain` clips are grey: frame i is level 7·i mod 256, so a decoded frame's mean names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.app.video.container import open_container, video_stream
from kiln.app.video.index import read_index
from kiln.app.video.reader import VideoReader
from kiln.app.video.sampling import sample_times
from tests.videos import plain, shows


@pytest.fixture(scope="module")
def short_gops(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 s at 10 fps, a keyframe every 10 frames."""
    return plain(tmp_path_factory.mktemp("videos") / "short_gops.mkv", 600, gop=10)


def test_the_index_knows_every_frame_and_keyframe(short_gops: Path) -> None:
    with open_container(short_gops) as container:
        index = read_index(container, video_stream(container))
    assert len(index.times) == 600 and index.end_s == pytest.approx(60.0)
    assert index.keyframes == pytest.approx([k for k in range(60)])
    assert index.shown_at(12.34) == 123 and index.gop_of(12.34) == 12
    assert index.time_shown_at(12.34) == pytest.approx(12.3)
    assert index.ends_before(60.0) and not index.ends_before(59.95)


def test_an_index_until_a_moment_reads_a_little_past_it(short_gops: Path) -> None:
    """A reader of one frame (a thumbnail) reads the packets up to it and a few after, and
    knows every frame and keyframe until then as the whole index does."""
    with open_container(short_gops) as container:
        index = read_index(container, video_stream(container), until=12.34)
    assert 124 <= len(index.times) < 200 and index.times[:124] == pytest.approx(
        [k / 10 for k in range(124)]
    )
    assert index.keyframes[:13] == pytest.approx([k for k in range(13)])
    assert not index.ends_before(12.34)
    reader = VideoReader(short_gops, until=12.34)
    try:
        assert shows(reader.frame(12.34), 123)
    finally:
        reader.close()


def test_reading_every_frame_in_order_seeks_once(short_gops: Path) -> None:
    reader = VideoReader(short_gops)
    try:
        for number, t in enumerate(reader.index.times):
            assert shows(reader.frame(t, 0.0), number)
        assert reader.seeks == 1
    finally:
        reader.close()


def test_dense_sampling_decodes_on_past_keyframes(short_gops: Path) -> None:
    reader = VideoReader(short_gops)
    try:
        for t in sample_times(60.0, 2.0):
            assert shows(reader.frame(t, 2.0), round(t * 10))
        assert reader.seeks == 1
    finally:
        reader.close()


def test_sparse_sampling_seeks_to_each_frame_s_keyframe(short_gops: Path) -> None:
    times = sample_times(60.0, 0.1)
    assert times == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    reader = VideoReader(short_gops)
    try:
        for t in times:
            assert shows(reader.frame(t, 0.1), round(t * 10))
        assert reader.seeks == len(times)
        assert shows(reader.frame(55.5, 0.1), 555)  # mid-GOP: from its keyframe, 5 frames on
        assert reader.seeks == len(times) + 1
    finally:
        reader.close()


@pytest.mark.parametrize("suffix", ["ts", "mp4", "mkv"])
def test_reading_out_of_order_seeks_to_the_right_frames(tmp_path: Path, suffix: str) -> None:
    """Back and forth over short GOPs: every seek lands where the frame is decoded from (an
    MPEG-TS demuxer seeks by bytes and may land past the keyframe: then from the start)."""
    path = plain(tmp_path / f"sparse.{suffix}", 200, fps=10, gop=10)
    reader = VideoReader(path)
    try:
        for t in (15.0, 3.0, 9.5, 0.0, 19.9, 7.2, 12.1):
            assert shows(reader.frame(t), reader.index.shown_at(t)), t
        assert reader.seeks >= 6
    finally:
        reader.close()
