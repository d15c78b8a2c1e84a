"""Videos in a prep process (kiln.workers.prep.video): which frames a job samples (the plan), and
those frames decoded by presentation time, from every container Kiln reads; the bad videos
(cut short, damaged, audio only, empty, over a limit) fail with sentences.

The clips are made here (tests/videos.py). `plain` clips are grey: frame i is level 7·i mod 256,
so a decoded frame's mean names it, and its neighbours (7 levels away) are told apart."""

from __future__ import annotations

import math
import re
from pathlib import Path

import av
import numpy as np
import pytest

from kiln.app.core.errors import InputError
from kiln.app.video.index import EPS, VideoIndex
from kiln.app.video.reader import VideoReader
from kiln.app.video.sampling import VideoLimits, sample_count
from kiln.workers.prep import video as video_module
from kiln.workers.prep.video import FramePlan, VideoReaders, decoded_frame, plan
from tests.videos import (
    audio_only,
    cut,
    damaged,
    grey,
    level,
    numbered,
    plain,
    shows,
    variable_rate,
)

LIMITS = VideoLimits(max_frames=100_000, max_duration_s=24 * 3600.0)
SUFFIXES = ["mp4", "mov", "mkv", "webm", "avi", "ts"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("videos")


@pytest.fixture(scope="module")
def clips(folder: Path) -> dict[str, Path]:
    """3 s at 10 fps (30 frames) in each container."""
    return {suffix: plain(folder / f"plain.{suffix}", 30) for suffix in SUFFIXES}


@pytest.fixture(scope="module")
def long_numbered(folder: Path) -> Path:
    """30 s at 10 fps, each frame showing its number."""
    return numbered(folder / "numbered.mkv", 30)


def reference(path: Path) -> dict[int, np.ndarray]:
    """Every frame of a clip, decoded front to back by PyAV alone, by its position."""
    with av.open(str(path)) as container:
        frames = sorted(
            (frame.pts, frame.to_ndarray(format="gray"))
            for frame in container.decode(container.streams.video[0])
        )
    return {i: pixels for i, (_pts, pixels) in enumerate(frames)}


# --- every container -------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_clip_sampled_at_2_fps_gives_the_frames_shown_then(
    clips: dict[str, Path], suffix: str
) -> None:
    made = plan(clips[suffix], 2.0, LIMITS)
    assert isinstance(made, FramePlan)
    assert made.times == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert made.indices == [0, 5, 10, 15, 20, 25]
    assert made.duration_s == pytest.approx(3.0, abs=0.05)
    assert len(made.gops) == 6 and all(g >= 0 for g in made.gops)
    reader = VideoReader(clips[suffix])
    try:
        for t, index in zip(made.times, made.indices, strict=True):
            frame = reader.frame(t, 2.0)
            assert shows(frame, index), f"{suffix}: at {t} s level {grey(frame):.1f}"
        assert reader.seeks == 1
    finally:
        reader.close()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_every_frame_is_planned_at_fps_0(clips: dict[str, Path], suffix: str) -> None:
    made = plan(clips[suffix], 0.0, LIMITS)
    assert made.indices == list(range(30))
    assert made.times == pytest.approx([i / 10 for i in range(30)], abs=1e-3)
    reader = VideoReader(clips[suffix])
    try:
        got = [grey(reader.frame(t, 0.0)) for t in made.times]
    finally:
        reader.close()
    assert got == pytest.approx([level(i) for i in range(30)], abs=3.0)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_the_bytes_of_a_video_are_read_as_its_file_is(clips: dict[str, Path], suffix: str) -> None:
    """A fetched video (bytes, not a path) plans and decodes the same."""
    data = clips[suffix].read_bytes()
    assert plan(data, 2.0, LIMITS) == plan(clips[suffix], 2.0, LIMITS)
    reader = VideoReader(data)
    try:
        assert shows(reader.frame(1.5, 2.0), 15)
        assert shows(reader.frame(2.9, 2.0), 29)
    finally:
        reader.close()


def test_moments_between_frames_get_the_frame_on_screen(clips: dict[str, Path]) -> None:
    reader = VideoReader(clips["mp4"])
    try:
        for t, number in [(0.0, 0), (0.05, 0), (0.0999, 0), (0.1, 1), (0.26, 2), (2.95, 29)]:
            assert shows(reader.frame(t), number), t
        assert shows(reader.frame(0.7), 7)  # backwards: a seek, the right frame still
        assert reader.seeks == 2
    finally:
        reader.close()


def test_a_moment_at_or_past_the_end_is_not_a_frame(clips: dict[str, Path]) -> None:
    reader = VideoReader(clips["mkv"])
    try:
        with pytest.raises(InputError, match=r"^The video ends at 3\.0 s;"):
            reader.frame(3.0, 2.0)
    finally:
        reader.close()


# --- variable frame rate ----------------------------------------------------------------------

VFR_TIMES = [0.0, 0.1, 0.15, 0.5, 0.55, 1.2, 1.3, 2.0]


def shown_at(t: float) -> int:
    return max(i for i, start in enumerate(VFR_TIMES) if start <= t + 1e-9)


def test_a_variable_rate_video_is_sampled_by_presentation_time(folder: Path) -> None:
    path = variable_rate(folder / "variable.mkv", VFR_TIMES)
    made = plan(path, 10.0, LIMITS)
    first: dict[int, float] = {}  # each frame at the first moment k/10 it is on screen
    for k in range(21):
        first.setdefault(shown_at(k / 10), k / 10)
    assert made.indices == list(first) == list(range(8))  # frame 2 on screen 0.2–0.4 s: once
    assert made.times == pytest.approx([0.0, 0.1, 0.2, 0.5, 0.6, 1.2, 1.3, 2.0])
    frames = reference(path)
    assert len(frames) == len(VFR_TIMES)
    reader = VideoReader(path)
    try:
        for t in [*made.times, 0.12, 0.149, 0.151, 0.52, 1.25, 1.999]:
            got = reader.frame(t, 10.0).to_ndarray(format="gray")
            assert np.array_equal(got, frames[shown_at(t)]), f"at {t} s"
    finally:
        reader.close()


# --- a rate above the video's own -------------------------------------------------------------


@pytest.mark.parametrize("fps", [15.0, 10.0, 500.0, 1000.0])
@pytest.mark.parametrize("suffix", ["mp4", "mkv", "ts"])
def test_a_rate_above_the_video_s_own_gives_each_frame_once(
    clips: dict[str, Path], suffix: str, fps: float
) -> None:
    """500 fps of a 10 fps clip is its 30 frames, each at the first moment it is on screen —
    not 50 items of each; what `fps 0` gives, on the grid of the rate asked."""
    made = plan(clips[suffix], fps, LIMITS)
    assert made.indices == list(range(30))
    assert made.times == pytest.approx([math.ceil(i / 10 * fps - 1e-6) / fps for i in range(30)])
    assert len({round(t, 3) for t in made.times}) == 30
    assert plan(clips[suffix], 0.0, LIMITS).indices == made.indices
    reader = VideoReader(clips[suffix])
    try:
        assert all(
            shows(reader.frame(t, fps), i) for t, i in zip(made.times, made.indices, strict=True)
        )
    finally:
        reader.close()


def test_a_rate_above_the_video_s_own_is_within_the_frame_limit(clips: dict[str, Path]) -> None:
    """The limit counts the frames a plan gives: 30, not the 15,000 moments of 500 fps."""
    assert len(plan(clips["mkv"], 500.0, VideoLimits(30, 3600.0)).times) == 30
    with pytest.raises(InputError, match=r"at 500 frames per second gives 30 frames, over the 29"):
        plan(clips["mkv"], 500.0, VideoLimits(29, 3600.0))


@pytest.mark.parametrize("fps", [0.7, 3.0, 9.99, 10.0, 13.0, 30.0, 333.0, 1000.0])
def test_each_frame_is_planned_at_the_first_moment_it_is_on_screen(fps: float) -> None:
    """Against every moment k/fps enumerated: each frame once, at its first moment; a frame no
    moment falls on, not at all (a variable rate, frames 1 ms to 0.9 s long)."""
    rng = np.random.default_rng(int(fps * 100))
    times = np.cumsum(np.concatenate([[0.0], rng.choice([0.001, 0.04, 0.1, 0.9], 299)]))
    index = VideoIndex(times.tolist(), times[::25].tolist(), 0.04, None, None)
    grid = [k / fps for k in range(sample_count(index.duration_s, fps))]
    first: dict[int, float] = {}
    for t in grid:
        if t < index.end_s - EPS:
            first.setdefault(index.shown_at(t), t)
    made = video_module.frame_plan(index, fps)
    assert made.indices == list(first) and made.times == list(first.values())


def test_past_a_cut_a_rate_above_the_video_s_own_fails_a_moment_per_frame(
    long_numbered: Path, tmp_path: Path
) -> None:
    """A cut file at 500 fps: the moments past the cut (whose frames cannot be known) are
    sampled one frame apart, and the sentence counts them."""
    path = cut(long_numbered, tmp_path / "cut.mkv", 0.4)
    made = plan(path, 500.0, LIMITS)
    decoded = [i for i in made.indices if i >= 0]
    assert decoded == list(range(len(decoded)))
    past = [t for t, i in zip(made.times, made.indices, strict=True) if i < 0]
    assert 0 < len(past) == 300 - len(decoded) + 1 or 0 < len(past) == 300 - len(decoded)
    assert np.diff(past) == pytest.approx([0.1] * (len(past) - 1))
    reader = VideoReader(path)
    try:
        with pytest.raises(InputError) as caught:
            reader.frame(past[0], 500.0)
    finally:
        reader.close()
    found = PAST_END.match(str(caught.value))
    assert found is not None and int(found[2]) == len(past)


# --- cut short, damaged -----------------------------------------------------------------------

PAST_END = re.compile(
    r"^The video ends at (\d+\.\d) s; (\d+) sampled frames after it were not decodable\.$"
)


def decodable_end(path: Path) -> float:
    """Where the frames PyAV decodes from a file end (its last frame's time plus one frame)."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        pts: list[int] = []
        try:
            for frame in container.decode(stream):
                if frame.pts is not None:
                    pts.append(frame.pts)
        except av.error.FFmpegError:  # the cut: what decoded so far
            pass
        return (max(pts) - min(pts)) * float(stream.time_base or 0) + 0.1


def test_a_cut_file_plans_its_header_duration_and_fails_the_frames_past_the_cut(
    long_numbered: Path, tmp_path: Path
) -> None:
    path = cut(long_numbered, tmp_path / "cut.mkv", 0.4)
    end = decodable_end(path)
    assert 3.0 < end < 27.0
    made = plan(path, 2.0, LIMITS)
    assert made.times == [k / 2 for k in range(60)]  # the header's 30 s
    assert made.duration_s == pytest.approx(30.0, abs=0.05)
    before = [t for t in made.times if t < end - 1e-6]
    after = len(made.times) - len(before)
    assert after > 0 and made.indices[len(before) :] == [-1] * after
    assert made.indices[: len(before)] == [round(t * 10) for t in before]
    frames = reference(long_numbered)
    reader = VideoReader(path)
    try:
        for t in before:
            got = reader.frame(t, 2.0).to_ndarray(format="gray")
            assert np.abs(got.astype(int) - frames[round(t * 10)]).mean() < 1.0, f"at {t} s"
        sentences = set()
        for t in made.times[len(before) :]:
            with pytest.raises(InputError) as caught:
                reader.frame(t, 2.0)
            sentences.add(str(caught.value))
    finally:
        reader.close()
    assert len(sentences) == 1
    found = PAST_END.match(sentences.pop())
    assert found is not None
    assert float(found[1]) == pytest.approx(end, abs=0.051)
    assert int(found[2]) == after


def packet_spans(path: Path) -> list[tuple[int, int, bool]]:
    """Each frame's packet, in presentation order: where it lies in the file, its size, and
    whether it is a keyframe."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        packets = sorted(
            (p.pts or 0, p.pos if p.pos is not None else -1, p.size, p.is_keyframe)
            for p in container.demux(stream)
            if p.size and p.pts is not None
        )
    return [(pos, size, key) for _pts, pos, size, key in packets]


def frames_held(path: Path) -> set[int]:
    """The frames (by number, at 10 fps) whose packets a damaged file still holds."""
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        pts: list[int] = []
        try:
            for packet in container.demux(stream):
                if packet.size and packet.pts is not None:
                    pts.append(packet.pts)
        except av.error.FFmpegError:  # a damaged tail: what was read so far
            pass
        return {round((p - min(pts)) * float(stream.time_base or 0) * 10) for p in pts}


@pytest.mark.parametrize(
    ("suffix", "fps"),
    [("mp4", 10.0), ("mp4", 0.0), ("mov", 10.0), ("mkv", 0.0), ("ts", 0.0)],
)
def test_a_damaged_stretch_fails_its_own_frames_and_no_other(
    folder: Path, tmp_path: Path, suffix: str, fps: float
) -> None:
    """Noise over 3 % of the file, mid-GOP (keyframes every 10 frames). A frame whose packets
    are damaged — or that is decoded from a damaged frame — fails with a sentence; it is never
    answered with another frame (a decoder's concealment shows a neighbour's pixels). Frames
    before the damage, and from the first keyframe after it, decode as they should.

    The clips and the noise are deterministic (x264's output does not depend on the thread
    count here), and this noise is detectable: FFmpeg reports an error on the packets it
    breaks, or flags the frames it conceals as corrupt. (Noise that happens to parse as a valid
    "nothing changed" frame could not be told from one; the seed is not such a case.)"""
    source = plain(folder / f"gops.{suffix}", 100, gop=10)
    start, length = 0.5, 0.03
    path = damaged(source, tmp_path / f"damaged.{suffix}", start, length)
    size = source.stat().st_size
    first, last = int(size * start), int(size * start) + int(size * length)
    spans = packet_spans(source)
    assert len(spans) == 100 and all(pos >= 0 for pos, _, _ in spans)
    hit = [k for k, (pos, n, _) in enumerate(spans) if pos < last and pos + n > first]
    assert hit and max(pos + n for pos, n, _ in spans) > last  # the noise is among the frames
    # The first keyframe after the damage that the damaged file still holds (a Matroska
    # demuxer that loses its footing in a cluster skips to the next cluster).
    left = frames_held(path)
    keys = [k for k, (_, _, key) in enumerate(spans) if key and k > max(hit) and k in left]
    healed = keys[0] if keys else 100
    made = plan(path, fps, LIMITS)
    reader = VideoReader(path)
    failed, wrong = [], []
    try:
        for t in made.times:
            number = round(t * 10)  # the frame shown at t (10 fps, constant)
            try:
                frame = reader.frame(t, fps)
            except InputError as error:
                assert str(error).endswith("."), str(error)
                failed.append(number)
                continue
            if not shows(frame, number):
                wrong.append((number, round(grey(frame))))
    finally:
        reader.close()
    assert not wrong, f"frames answered with other pixels (frame, level): {wrong}; hit {hit}"
    assert failed, f"no frame failed though packets {hit} were overwritten"
    assert all(min(hit) <= k < healed for k in failed), (failed, hit, healed)
    good = [k for k in range(100) if k < min(hit) or k >= healed]
    sampled = {round(t * 10) for t in made.times}
    assert all(k in sampled for k in good), "a frame outside the damage is not even planned"


# --- not a video, or over a limit -------------------------------------------------------------


def test_audio_only_is_refused_with_a_sentence(tmp_path: Path) -> None:
    path = audio_only(tmp_path / "voice.mp4")
    with pytest.raises(InputError, match=r"audio only.*no frames to sample\.$"):
        plan(path, 1.0, LIMITS)
    with pytest.raises(InputError, match="no video stream"):
        plan(path.read_bytes(), 1.0, LIMITS)
    with pytest.raises(InputError, match="no video stream"):
        VideoReader(path)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="zero-length-bytes"),
        pytest.param(b"just some text, " * 64, id="text"),
        pytest.param(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 200, id="a-header-alone"),
    ],
)
def test_what_is_not_a_video_is_refused_with_a_sentence(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "input.mp4"
    path.write_bytes(data)
    for given in (data, path):
        with pytest.raises(InputError, match=r"^The (file|video) .+\.$"):
            plan(given, 1.0, LIMITS)


def test_a_codec_ffmpeg_does_not_know_is_refused_with_a_sentence(tmp_path: Path) -> None:
    """An MKV whose track names a codec no one has heard of: one sentence for the video, not
    one per frame."""
    data = plain(tmp_path / "clip.mkv", 20, fps=10).read_bytes()
    assert b"V_MPEG4/ISO/AVC" in data
    unknown = data.replace(b"V_MPEG4/ISO/AVC", b"V_XXXXX/ISO/XYZ")
    with pytest.raises(InputError, match=r"^The video's codec is not one FFmpeg knows, so Kiln"):
        plan(unknown, 1.0, LIMITS)


def test_a_frame_rate_field_of_0_is_sampled_by_the_frames_own_times(tmp_path: Path) -> None:
    """An AVI whose stream header says 0 frames per second: its frames still carry their
    timestamps, which is what sampling reads; the frames are the ones shown then."""
    data = bytearray(plain(tmp_path / "clip.avi", 20, fps=10).read_bytes())
    rate = (
        data.find(b"strh") + 8 + 24
    )  # fccType, handler, flags, priority, language, initial, scale
    assert int.from_bytes(data[rate : rate + 4], "little") == 10
    data[rate : rate + 4] = (0).to_bytes(4, "little")
    made = plan(bytes(data), 2.0, LIMITS)
    assert made.indices == [0, 5, 10, 15]
    reader = VideoReader(bytes(data))
    assert [shows(reader.frame(t), k) for t, k in zip(made.times, made.indices, strict=True)] == [
        True
    ] * 4


def test_a_truncated_video_with_no_frames_left_is_refused(
    clips: dict[str, Path], tmp_path: Path
) -> None:
    path = cut(clips["mkv"], tmp_path / "stub.mkv", 0.02)
    with pytest.raises(InputError, match=r"\.$"):
        plan(path, 1.0, LIMITS)


def test_a_video_over_the_duration_limit_is_refused(clips: dict[str, Path]) -> None:
    short = VideoLimits(max_frames=100_000, max_duration_s=2.0)
    for fps in (1.0, 0.0):
        with pytest.raises(InputError, match=r"over the 2 s limit \(KILN_MAX_VIDEO_DURATION_S\)"):
            plan(clips["mp4"], fps, short)


def test_a_video_sampled_over_the_frame_limit_is_refused(clips: dict[str, Path]) -> None:
    few = VideoLimits(max_frames=5, max_duration_s=3600.0)
    with pytest.raises(InputError, match=r"gives 6 frames, over the 5 limit") as caught:
        plan(clips["mkv"], 2.0, few)
    assert "KILN_MAX_VIDEO_FRAMES" in str(caught.value)
    with pytest.raises(InputError, match=r"every frame gives 30 frames, over the 5 limit"):
        plan(clips["mkv"], 0.0, few)
    assert len(plan(clips["mkv"], 1.0, few).times) == 3  # within it at a lower rate


# --- seeking ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_gops(folder: Path) -> Path:
    """60 s at 10 fps, a keyframe every 10 frames."""
    return plain(folder / "short_gops.mkv", 600, gop=10)


def test_each_frame_is_decoded_from_its_gop_s_keyframe(short_gops: Path) -> None:
    assert plan(short_gops, 0.1, LIMITS).gops == [0, 10, 20, 30, 40, 50]


# --- the readers a prep process keeps ---------------------------------------------------------


def test_readers_continue_where_they_stopped_and_are_bounded(
    clips: dict[str, Path], short_gops: Path
) -> None:
    readers = VideoReaders(most=2)
    try:
        first = readers.reader("a", 0.0, short_gops)
        assert shows(first.frame(0.0), 0)
        again = readers.reader("a", 0.5, short_gops)  # just ahead: the same reader reads on
        assert again is first and shows(again.frame(0.5), 5) and first.seeks == 1
        assert first.continues_to(1.0) and not first.continues_to(30.0)
        assert readers.readers_of("a") == 1
        b = readers.reader("b", 0.0, clips["mp4"])
        assert b is not first and readers.readers_of("b") == 1
        assert readers.reader("a", 1.0, short_gops) is first  # a, b: b is now the oldest
        c = readers.reader("c", 0.0, clips["mkv"])
        assert readers.readers_of("b") == 0  # closed: at most two open
        assert readers.readers_of("a") == 1 and readers.readers_of("c") == 1
        assert len(readers._open) == 2
        assert shows(c.frame(2.0), 20) and shows(first.frame(1.0), 10)
        again_b = readers.reader("b", 0.0, clips["mp4"])
        assert again_b is not b and shows(again_b.frame(0.0), 0)
        assert readers.readers_of("a") == 0 and len(readers._open) == 2
    finally:
        readers.close()
    assert readers._open == []


def test_fetched_videos_are_held_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video_module, "HELD_VIDEO_BYTES", 250)
    readers = VideoReaders()
    readers.hold("s1", b"1" * 100)
    readers.hold("s2", b"2" * 100)
    assert readers.held("s1") == b"1" * 100  # s1 is now the most recently used
    readers.hold("s3", b"3" * 100)  # 300 bytes: the least recently used goes
    assert readers.held("s2") is None
    assert readers.held("s1") == b"1" * 100 and readers.held("s3") == b"3" * 100
    readers.hold("big", b"b" * 1000)  # over the bound alone: kept, the others go
    assert readers.held("big") == b"b" * 1000
    assert readers.held("s1") is None and readers.held("s3") is None
    readers.close()
    assert readers.held("big") is None


# --- a frame as the image preps take ----------------------------------------------------------


@pytest.fixture(scope="module")
def hd_frame() -> av.VideoFrame:
    """1280×720: red on the left half, blue on the right."""
    pixels = np.zeros((720, 1280, 3), np.uint8)
    pixels[:, :640] = (255, 0, 0)
    pixels[:, 640:] = (0, 0, 255)
    return av.VideoFrame.from_ndarray(pixels, format="rgb24")


@pytest.mark.parametrize(
    ("want", "size"),
    [
        ((160, 90), (160, 90)),  # by 8
        ((100, 50), (160, 90)),
        ((200, 100), (320, 180)),  # by 4
        ((600, 300), (640, 360)),  # by 2
        ((641, 10), (1280, 720)),  # no reduction keeps the fit's width: full size
        ((1280, 720), (1280, 720)),
        ((4000, 3000), (1280, 720)),
        (None, (1280, 720)),
    ],
)
def test_a_frame_is_reduced_only_as_far_as_the_fit_allows(
    hd_frame: av.VideoFrame, want: tuple[int, int] | None, size: tuple[int, int]
) -> None:
    decoded = decoded_frame(hd_frame, want)
    assert decoded.image.size == size and decoded.image.mode == "RGB"
    assert (decoded.width, decoded.height) == (1280, 720)  # the frame's own size
    assert decoded.jpeg  # already lossy: resizing may take the draft's shortcuts
    pixels = np.asarray(decoded.image).astype(int)
    width = size[0]
    assert np.abs(pixels[:, : width // 2 - 2] - (255, 0, 0)).max() <= 3
    assert np.abs(pixels[:, width // 2 + 2 :] - (0, 0, 255)).max() <= 3


def test_another_stretch_of_a_video_gets_its_own_reader_sharing_the_index(
    short_gops: Path,
) -> None:
    """Two chunks of one video interleave in a process: each keeps its reader (no seeking back
    and forth), up to `per_video`; past it the video's oldest reader seeks."""
    readers = VideoReaders(most=4, per_video=2)
    try:
        early = readers.reader("a", 0.0, short_gops)
        assert shows(early.frame(0.0), 0)
        late = readers.reader("a", 8.0, short_gops)  # keyframes between: a reader of its own
        assert late is not early and late.index is early.index
        assert shows(late.frame(8.0), 80)
        assert readers.reader("a", 0.1, short_gops) is early  # each reads on where it was
        assert readers.reader("a", 8.1, short_gops) is late
        assert early.seeks == late.seeks == 1
        third = readers.reader("a", 5.0, short_gops)  # per_video reached: the oldest seeks
        assert third is early and readers.readers_of("a") == 2
    finally:
        readers.close()
