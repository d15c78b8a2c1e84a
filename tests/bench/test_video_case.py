"""The `video` case (bench/video.py) end to end on a tiny clip: the peer and `kiln run` for each
row, their counts, the phashes they agree on, the ratio targets. No timing is asserted beyond
"a number"; the sampling rule is checked on its own against frames of known times."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
from rich.console import Console

from bench import video
from bench.plan import ALL_CASES, PRESETS
from bench.results import targets
from bench.run import Runner
from bench.run import prepare as prepare_context

SECONDS = 2.0
SIZE = (320, 180)


@dataclass
class _Frame:
    pts: int
    time_base: Fraction = Fraction(1, 1000)


def _times(fps: float, stamps_ms: list[int], frame_s: float = 0.1) -> list[tuple[float, int]]:
    return [
        (t, f.pts) for t, f in video.sampled(iter(_Frame(ms) for ms in stamps_ms), fps, frame_s)
    ]


def test_sampling_takes_the_last_frame_shown_at_each_moment() -> None:
    # a stream starting at 0.5 s, frames 0.1 s apart with one gap: times 0, .1, .2, .5, .6
    stamps = [500, 600, 700, 1000, 1100]
    assert _times(0, stamps) == [(0.0, 500), (pytest.approx(0.1), 600), (pytest.approx(0.2), 700),
                                 (0.5, 1000), (pytest.approx(0.6), 1100)]  # fmt: skip
    # 5 fps: moments 0, .2, .4, .6 (the video ends at .6 + .1); .4 falls in the gap: .2's frame
    assert _times(5, stamps) == [(0.0, 500), (0.2, 700), (0.4, 700), (0.6, 1100)]
    assert video.expected_samples(90, 1) == 3 and video.expected_samples(90, 0) == 90
    assert video.expected_samples(91, 1) == 4  # 3.033 s: a moment at 3 s


def test_rows_give_the_detector_at_every_frame_its_own_clip() -> None:
    plan = PRESETS["default"]
    labels = [r.label for r in video.rows(plan)]
    assert labels == [
        "phash 1 fps, 600 s clip",
        "phash every frame, 600 s clip",
        "detector 1 fps, 600 s clip",
        "detector every frame, 60 s clip",
    ]
    quick = {r.seconds for r in video.rows(PRESETS["quick"])}
    assert quick == {20.0, 10.0}
    assert "video" in ALL_CASES and "video" in PRESETS["quick"].cases
    assert "video" not in PRESETS["smoke"].cases  # this test covers it instead


@pytest.mark.timeout(300)
def test_video_case_end_to_end_on_a_tiny_clip(tmp_path: Path) -> None:
    plan = PRESETS["smoke"].with_(
        cases=("video",), models=("detector",), video_seconds=SECONDS,
        detector_every_frame_seconds=1.0, video_size=SIZE,
    )  # fmt: skip
    ctx = prepare_context(plan, tmp_path, Console(quiet=True))
    runner = Runner(ctx, Console(quiet=True))
    runner.global_cases()
    assert runner.failures == []

    clip = video.clip_path(tmp_path / "videos", SECONDS, SIZE)
    facts = video.clip_facts(clip)
    assert facts["frames"] == 60 and facts["size"] == "320x180" and facts["keyframes"] >= 1
    assert "keyint=250" in facts["x264"] and "sliced_threads=0" in facts["x264"]

    expected = {
        "phash 1 fps, 2 s clip": 2,
        "phash every frame, 2 s clip": 60,
        "detector 1 fps, 2 s clip": 2,
        "detector every frame, 1 s clip": 30,
    }
    by = {(r.case, r.model): r for r in runner.results}
    assert set(by) == {(case, label) for case in video.CASES for label in expected}
    for (case, label), result in by.items():
        assert result.items == expected[label], (case, label)
        assert result.extra["expected_samples"] == expected[label]
        assert result.seconds > 0 and math.isfinite(result.items_per_s)
        assert result.peak_rss_mb["subject"] > 0 and result.cpu_seconds["subject"] > 0
    for label in ("phash 1 fps, 2 s clip", "phash every frame, 2 s clip"):
        # the same frames, prepared the same way: the same hashes
        assert by[("video-kiln", label)].extra["phash_same_as_peer"] == 1.0
    assert by[("video-peer", "phash 1 fps, 2 s clip")].extra["clip"]["frames"] == 60

    goals = {t.name: t for t in targets(runner.results, list(plan.models), 16)}
    for label in expected:
        goal = goals[f"V video {label}: kiln run ÷ PyAV loop"]
        assert isinstance(goal.value, float) and goal.value > 0 and goal.goal == "≥ 1.20"


def test_a_kiln_run_with_failed_frames_is_a_failure_not_a_rate(tmp_path: Path) -> None:
    """Kiln refusing the video (over KILN_MAX_VIDEO_FRAMES) fails its one item, so `kiln run`
    exits 1 (no item succeeded) with the item's sentence: the attempt fails with that sentence,
    and no rate is reported for it."""
    plan = PRESETS["smoke"].with_(
        cases=("video",), models=("detector",), video_size=SIZE,
        kiln_env=(*PRESETS["smoke"].kiln_env, ("KILN_MAX_VIDEO_FRAMES", "1")),
    )  # fmt: skip
    ctx = prepare_context(plan, tmp_path, Console(quiet=True))
    row = video.Row("phash", 1.0, SECONDS)
    runner = Runner(ctx, Console(quiet=True))
    assert runner.attempt("video-kiln refused", lambda: [video.run_kiln(ctx, row)]) == []
    [failure] = runner.failures
    assert "exited 1" in failure and "KILN_MAX_VIDEO_FRAMES" in failure
    assert runner.results == []
