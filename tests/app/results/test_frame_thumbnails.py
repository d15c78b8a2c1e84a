"""Thumbnails of videos' frames (app/results/thumbnails.py): the frame on screen at the moment, as
the worker gave it to the model (the last frame at or before it), decoded with PyAV from bytes or a
file; past a cut file's end, in a damaged stretch or from no video at all, a sentence."""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import pytest
from PIL import Image, ImageChops, ImageStat

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.results.thumbnails import _VideoBytes, frame_thumbnail
from kiln.app.video.reader import VideoReader
from tests.videos import (
    audio_only,
    cut,
    damaged,
    grey,
    number_frame,
    numbered,
    plain,
    variable_rate,
)

PIXELS = 50_000_000
SIZE = (320, 240)


def picture(data: bytes) -> Image.Image:
    with Image.open(io.BytesIO(data)) as image:
        assert image.format == "JPEG"
        return image.convert("L")


def shown_number(data: bytes, candidates: range, size: tuple[int, int] = SIZE) -> int:
    """Which of the numbered frames the thumbnail shows: the one it differs from least."""
    got = picture(data)

    def distance(n: int) -> float:
        drawn = number_frame(n, *size).convert("L").resize(got.size)
        return float(ImageStat.Stat(ImageChops.difference(got, drawn)).mean[0])

    return min(candidates, key=distance)


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 s at 10 frames per second, a keyframe every 10: frame i shows i."""
    folder = tmp_path_factory.mktemp("frames")
    return numbered(folder / "clip.mp4", 3, 10, SIZE, gop=10, faststart=True)


@pytest.mark.parametrize(
    ("moment", "number"),
    [(0.0, 0), (0.05, 0), (0.1, 1), (1.0, 10), (1.25, 12), (1.9999995, 20), (2.95, 29)],
)
def test_the_frame_on_screen_at_the_moment_is_shown(clip: Path, moment: float, number: int) -> None:
    data = frame_thumbnail(clip.read_bytes(), moment, PIXELS, side=192)
    assert picture(data).size == (192, 144)
    assert shown_number(data, range(30)) == number


def test_a_file_is_read_where_it_is(clip: Path) -> None:
    assert shown_number(frame_thumbnail(clip, 2.0, PIXELS), range(30)) == 20


@pytest.mark.parametrize("suffix", ["mkv", "webm", "avi", "ts", "mov"])
def test_every_container_seeks_to_its_frame(tmp_path: Path, suffix: str) -> None:
    video = numbered(tmp_path / f"clip.{suffix}", 2, 10, SIZE, gop=5)
    for moment, number in ((0.0, 0), (0.75, 7), (1.9, 19)):
        data = frame_thumbnail(video.read_bytes(), moment, PIXELS)
        assert shown_number(data, range(20)) == number, (suffix, moment)


def test_a_variable_frame_rate_shows_the_frame_still_on_screen(tmp_path: Path) -> None:
    video = variable_rate(tmp_path / "vfr.mkv", [0.0, 0.5, 0.6, 2.0])
    for moment, number in ((0.4, 0), (0.55, 1), (1.9, 2), (2.0, 3)):
        data = frame_thumbnail(video, moment, PIXELS)
        assert shown_number(data, range(4), (160, 120)) == number, moment


def test_past_the_end_is_not_found_with_a_sentence(clip: Path) -> None:
    with pytest.raises(
        NotFoundError,
        match=r"^The video of item 'c#t=3\.500' ends at 3\.0 s; it has no frame at 3\.500 s\.$",
    ):
        frame_thumbnail(clip.read_bytes(), 3.5, PIXELS, "The video of item 'c#t=3.500'")


def test_a_cut_file_answers_before_its_cut_and_a_sentence_after(clip: Path, tmp_path: Path) -> None:
    short = cut(clip, tmp_path / "cut.mp4", 0.5).read_bytes()
    assert shown_number(frame_thumbnail(short, 0.5, PIXELS), range(30)) == 5
    with pytest.raises(
        NotFoundError, match=r"^The video ends at 1\.\d s; it has no frame at 2\.500 s\.$"
    ):
        frame_thumbnail(short, 2.5, PIXELS, "The video")


def test_a_damaged_frame_is_a_sentence_never_its_neighbour(clip: Path, tmp_path: Path) -> None:
    broken = damaged(clip, tmp_path / "damaged.mp4", 0.45, 0.1).read_bytes()
    answered, refused = 0, 0
    for number in range(30):
        try:
            data = frame_thumbnail(broken, number / 10, PIXELS)
        except NotFoundError as error:
            assert "is damaged at" in str(error) and "could not be decoded" in str(error)
            refused += 1
        else:
            answered += 1
            assert shown_number(data, range(30)) == number  # never another frame
    assert answered and refused


@pytest.mark.parametrize("suffix", ["mp4", "mkv"])
def test_a_frame_the_worker_fails_is_refused_the_same_way(tmp_path: Path, suffix: str) -> None:
    """The corrupt-frame rule is the worker's: a damaged stretch (noise mid-GOP, as
    tests/workers/prep/test_video.py) refuses the thumbnail of exactly the frames a prep
    process's reader fails — those whose packets broke, and those decoded from them, which
    FFmpeg would show with a neighbour's pixels patched in — and draws every other frame."""
    source = plain(tmp_path / f"gops.{suffix}", 100, gop=10)
    path = damaged(source, tmp_path / f"damaged.{suffix}", 0.5, 0.03)
    data = path.read_bytes()
    worker = VideoReader(path)  # as a prep process reads every frame, in order
    failed, refused = set(), set()
    try:
        for number in range(100):
            try:
                given = grey(worker.frame(number / 10, 0.0))
            except InputError:
                failed.add(number)
            try:
                thumb = frame_thumbnail(data, number / 10, PIXELS)
            except NotFoundError as error:
                assert re.fullmatch(
                    r"The video is damaged at \d+\.\d{3} s: the frame shown then could not be "
                    r"decoded\.",
                    str(error),
                )
                refused.add(number)
            else:  # the frame the worker gave the model, no other
                assert number not in failed
                assert abs(ImageStat.Stat(picture(thumb)).mean[0] - given) <= 3, number
    finally:
        worker.close()
    assert failed and refused == failed


def test_not_a_video_or_no_picture_in_it_is_a_sentence(tmp_path: Path, clip: Path) -> None:
    with pytest.raises(
        InputError,
        match=r"^Item 'x' cannot be read as a video\. The file is not a video Kiln can read \(",
    ):
        frame_thumbnail(b"not a video at all", 0.0, PIXELS, "Item 'x'")
    sound = audio_only(tmp_path / "sound.mp4").read_bytes()
    with pytest.raises(InputError, match=r"audio streams but no video stream \(audio only\)"):
        frame_thumbnail(sound, 0.0, PIXELS)
    with pytest.raises(InputError, match=r"is 320×240 pixels, more than Kiln decodes"):
        frame_thumbnail(clip.read_bytes(), 0.0, 10_000)


def test_boxes_are_drawn_in_the_frames_pixels(clip: Path) -> None:
    plain = picture(frame_thumbnail(clip, 1.0, PIXELS, side=160))
    boxed = picture(
        frame_thumbnail(clip, 1.0, PIXELS, side=160, boxes=[("cat", [160, 0, 319, 119])])
    )
    changed = ImageChops.difference(plain, boxed).point(lambda v: 255 if v > 60 else 0).getbbox()
    assert changed is not None
    assert changed[0] >= 75 and changed[3] <= 65  # the frame's top right quarter, at half size


def test_a_video_is_read_once_for_many_frames_at_once() -> None:
    kept = _VideoBytes()
    reads: list[int] = []

    def read() -> bytes:
        reads.append(1)
        time.sleep(0.05)
        return b"video bytes"

    answers: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: answers.append(kept.get("store:v", read))) for _ in range(6)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers == [b"video bytes"] * 6 and len(reads) == 1
    big = _VideoBytes(most=40)
    big.get("store:big", lambda: b"x" * 21)  # over half the budget: never kept
    assert big.get("store:big", lambda: b"again") == b"again"
