"""How a job samples a video (kiln.app.video.sampling): its `video_fps`, the moments sampled,
the limits, and frame keys."""

from __future__ import annotations

import math

import pytest

from kiln.app.core.errors import InputError
from kiln.app.video.sampling import (
    VideoLimits,
    check_fps,
    frame_key,
    refusal,
    sample_count,
    sample_times,
    split_key,
)

LIMITS = VideoLimits(max_frames=100_000, max_duration_s=24 * 3600.0)


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
