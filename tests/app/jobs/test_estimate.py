"""The estimate's pure parts: listing or sampling a prefix (a fake S3 lister), video headers by
ranged reads, frames as a job samples them, and the time from measured runs."""

from __future__ import annotations

import random
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kiln.app.db.model_runs import Run
from kiln.app.jobs import estimate, estimate_videos
from kiln.app.jobs.estimate_listing import Listed, list_source
from kiln.app.jobs.ingest import Source
from kiln.app.jobs.throughput import Span
from kiln.app.video import read_header
from tests import videos

PAGE = 10


class FakeBucket:
    """ListObjectsV2 over sorted keys, `PAGE` entries a page, with Delimiter's folders."""

    def __init__(self, objects: dict[str, int]) -> None:
        self.objects = dict(sorted(objects.items()))
        self.calls = 0

    def __call__(self, prefix: str, delimiter: str, token: str | None) -> dict[str, Any]:
        self.calls += 1
        entries: list[tuple[str, int | None]] = []
        seen: set[str] = set()
        for key, size in self.objects.items():
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if delimiter and delimiter in rest:
                folder = prefix + rest[: rest.index(delimiter) + 1]
                if folder not in seen:
                    seen.add(folder)
                    entries.append((folder, None))
                continue
            entries.append((key, size))
        start = int(token or 0)
        page = entries[start : start + PAGE]
        more = start + PAGE < len(entries)
        return {
            "Contents": [{"Key": k, "Size": s} for k, s in page if s is not None],
            "CommonPrefixes": [{"Prefix": k} for k, s in page if s is None],
            "IsTruncated": more,
            **({"NextContinuationToken": str(start + PAGE)} if more else {}),
        }


def test_a_small_prefix_is_listed_whole_with_the_filters() -> None:
    bucket = FakeBucket(
        {f"p/{i:03d}.jpg": 100 for i in range(25)} | {"p/notes.txt": 5, "p/x/": 0, "q/a.jpg": 1}
    )
    listing = list_source(bucket, Source("s3://b/p/", ("*.jpg",)), 1000, 10.0)
    assert listing.complete and not listing.sampled and not listing.note
    assert listing.listed == 25 and sum(o.size for o in listing.counted) == 2500


def test_a_huge_prefix_samples_whole_sub_folders_at_random() -> None:
    # 40 folders of 5 to 40 objects: listing stops after 100 objects, in the first folders
    sizes = [5 + (i * 7) % 36 for i in range(40)]
    objects = {f"p/f{i:02d}/{j:03d}.jpg": 1000 for i, n in enumerate(sizes) for j in range(n)}
    truth = len(objects)
    totals = []
    for seed in range(200):
        listing = list_source(FakeBucket(objects), Source("s3://b/p/"), 100, 10.0,
                              random.Random(seed))  # fmt: skip
        assert not listing.complete and not listing.lower_bound
        assert "chosen at random" in listing.note
        totals.append(sum(weight for _, weight in listing.weighted()))
        assert listing.listed < truth
    # each draw counts what the flat pages covered whole, and scales a random sample of the
    # rest: over draws the mean is the truth (Horvitz–Thompson), not the first folders' size
    assert statistics.mean(totals) == pytest.approx(truth, rel=0.05)


def test_a_prefix_without_its_slash_is_sampled_in_its_one_folder() -> None:
    objects = {f"p/f{i:02d}/{j:02d}.jpg": 1 for i in range(30) for j in range(10)}
    listing = list_source(FakeBucket(objects), Source("s3://b/p"), 100, 10.0, random.Random(1))
    assert not listing.lower_bound and "chosen at random" in listing.note
    # equal folders: every draw is exact
    assert sum(weight for _, weight in listing.weighted()) == pytest.approx(300)


def test_a_huge_flat_prefix_is_a_lower_bound_that_says_so() -> None:
    objects = {f"p/{i:04d}.jpg": 10 for i in range(100)}
    listing = list_source(FakeBucket(objects), Source("s3://b/p/"), 30, 10.0)
    assert listing.lower_bound and not listing.complete
    assert listing.listed == 30 and "lower bound" in listing.note


@pytest.mark.parametrize(
    ("key", "kind"),
    [("a/b.JPG", "image"), ("a/b.mp4", "video"), ("a/cam-1", "unknown"), ("a.d/cam", "unknown"),
     ("x.MKV", "video"), ("notes.txt", "unknown")],
)  # fmt: skip
def test_an_object_s_kind_by_its_name(key: str, kind: str) -> None:
    assert Listed(key, 1).kind == kind


def test_frames_as_a_job_samples_them() -> None:
    header = estimate_videos.VideoHeader(12.05, 121, 10.0)
    assert estimate_videos.sampled_frames(header, 5) == 61  # k/5 before 12.05 s
    assert estimate_videos.sampled_frames(header, 0) == 121  # every frame
    assert estimate_videos.sampled_frames(header, 50) == 121  # never more than it holds
    assert estimate_videos.sampled_frames(estimate_videos.VideoHeader(None, None, None), 1) is None
    assert estimate_videos.frames_from_bytes(500_000, 1) == 2  # 2 s at 2 Mbit/s


def _reader(data: bytes, reads: list[tuple[int, int]]) -> estimate_videos.RangeReader:
    def read(_key: str, first: int, last: int) -> bytes:
        reads.append((first, last))
        return data[first : last + 1]

    return read


def test_a_video_header_is_read_by_ranges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 30 s, its moov at the end: the header is read at both ends, not the middle
    data = videos.plain(tmp_path / "a.mp4", 300, fps=10, size=(320, 240)).read_bytes()
    monkeypatch.setattr(estimate_videos, "BLOCK", 8192)
    reads: list[tuple[int, int]] = []
    bound = len(data) // 2
    header = estimate_videos.header_of(_reader(data, reads), "a.mp4", len(data), bound)
    whole = read_header(data)
    assert header is not None and whole is not None
    assert (header.duration_s, header.frames, header.fps) == tuple(whole)
    assert sum(last - first + 1 for first, last in reads) <= bound
    assert max(last for _, last in reads) == len(data) - 1  # its end, where the moov is

    too_little = estimate_videos.header_of(_reader(data, []), "a.mp4", len(data), 8192)
    assert too_little is None  # over its bound: the frames come from bytes instead


def test_an_object_named_neither_is_known_by_its_first_bytes(tmp_path: Path) -> None:
    clip = videos.plain(tmp_path / "a.mkv", 10).read_bytes()
    assert estimate_videos.is_video(_reader(clip, []), "cam", len(clip))
    assert not estimate_videos.is_video(_reader(b"\xff\xd8\xff" + b"0" * 100, []), "x", 103)


T0 = datetime(2026, 11, 29, tzinfo=UTC)


def _run(
    items: int, per_s: float, chunk: int, lead_s: float = 1.0, warm_s: float = 0.0,
    frames: int = 0, frame_per_s: float = 0.0,
) -> Run:  # fmt: skip
    """A job whose chunks, after a first one slowed by `warm_s`, are written one after the
    other at `per_s` items a second; then `frames` frames at `frame_per_s`."""
    start = T0.timestamp() + lead_s
    spans = [Span(start, start + warm_s + chunk / per_s, chunk)]
    at = spans[0].end
    for _ in range(items // chunk - 1):
        spans.append(Span(at, at + chunk / per_s, chunk))
        at += chunk / per_s
    frame_spans = []
    for _ in range(frames // chunk):
        frame_spans.append(Span(at, at + chunk / frame_per_s, chunk))
        at += chunk / frame_per_s
    finished = T0 + timedelta(seconds=at - T0.timestamp() + 0.5)  # a close of 0.5 s
    return Run("j", spans + frame_spans, frame_spans, T0, finished)


def test_a_chunk_s_pace_times_a_job_in_rounds_of_the_slots_it_takes() -> None:
    measured = _run(400, per_s=100.0, chunk=8, lead_s=1.0, warm_s=3.0)  # one chunk at a time
    rate = estimate.fleet_rate([measured])
    assert rate.image_s == pytest.approx(1 / 100)  # the loading left out of the pace
    assert rate.frame_s == rate.image_s and not rate.frames_measured
    assert rate.slots_measured == pytest.approx(1.0)
    assert rate.overhead_s == pytest.approx(1.5)  # before the first lease, after the last write
    assert rate.warm_s == pytest.approx(3.0, abs=0.1)
    # 125 chunks of 8 on 2 workers of 4 threads and 4 prep processes (4 chunks at once a
    # worker, one a process: no saturation): 16 rounds of 8 chunks, 0.08 s each
    fleet = estimate.Fleet(2, rate, threads=4, chunk_size=8, prep_processes=4)
    shape = estimate.Shape.of(1000, 0, 0, fleet, prep_processes=4)
    assert (shape.chunks, shape.slots, shape.stretch) == (125, 8, 1.0)
    assert estimate.run_time(1000, 0, rate, shape, loaded=True) == pytest.approx(2.8)
    assert estimate.run_time(1000, 0, rate, shape, loaded=False) == pytest.approx(5.8, abs=0.1)
    # two chunks of 512 run at once whatever the workers: 5 s each
    big = estimate.Shape.of(1000, 0, 0, estimate.Fleet(3, rate, threads=16, chunk_size=512))
    assert estimate.run_time(1000, 0, rate, big, loaded=True) == pytest.approx(6.5)
    none = estimate.Shape.of(1000, 0, 0, estimate.Fleet(0, rate, threads=4, chunk_size=8))
    assert estimate.run_time(1000, 0, rate, none, loaded=True) is None  # no worker: no time
    note = estimate.time_note(estimate.Fleet(2, rate, loaded=True, prep_processes=4), shape)
    assert "8 at once" in note and "Extrapolated" not in note


def _parallel(at_once: int, chunks: int, per_s: float, chunk: int) -> Run:
    """A job whose chunks run `at_once` at a time, each at `per_s` items a second."""
    start = T0.timestamp() + 1.0
    took = chunk / per_s
    spans = [
        Span(start + (n // at_once) * took, start + (n // at_once + 1) * took, chunk)
        for n in range(chunks)
    ]
    finished = T0 + timedelta(seconds=max(s.end for s in spans) - T0.timestamp() + 0.5)
    return Run("p", spans, [], T0, finished)


def test_a_worker_past_what_was_measured_keeps_the_throughput_it_reached() -> None:
    # 2 chunks at once at 100 items/s each: the worker did 200 items/s
    rate = estimate.fleet_rate([_parallel(2, 8, per_s=100.0, chunk=100)])
    assert rate.slots_measured == pytest.approx(2.0)
    assert rate.image_s == pytest.approx(1 / 100)
    assert estimate.saturation(rate, prep_processes=1) == pytest.approx(2.0)
    # 10 chunks of 100 at once on one worker: 5× the measured, each at a fifth of the pace,
    # so the 1,000 items take what 200 items/s takes (5 s), not 1 s
    one = estimate.Fleet(1, rate, threads=16, chunk_size=100, prep_processes=1)
    shape = estimate.Shape.of(1000, 0, 0, one, prep_processes=1)
    assert shape.slots == 10 and shape.stretch == pytest.approx(5.0)
    fixed = rate.overhead_s
    assert estimate.run_time(1000, 0, rate, shape, loaded=True) == pytest.approx(
        fixed + 5.0, abs=0.1
    )
    note = estimate.time_note(one, shape)
    assert "Extrapolated" in note and "saturated beyond 2" in note
    # on 5 workers the same 10 chunks are 2 a worker: the measured pace, 1 s
    five = estimate.Shape.of(1000, 0, 0, estimate.Fleet(5, rate, threads=16, chunk_size=100))
    assert five.stretch == 1.0
    assert estimate.run_time(1000, 0, rate, five, loaded=True) == pytest.approx(
        fixed + 1.0, abs=0.1
    )
    # a worker of 8 prep processes runs 8 chunks at once at the pace (one a core): 10 → 1.25×
    wide = estimate.Shape.of(1000, 0, 0, one, prep_processes=8)
    assert wide.stretch == pytest.approx(1.25)


def test_a_frame_costs_what_runs_with_frames_took_beyond_their_images() -> None:
    images = _run(400, per_s=100.0, chunk=8)
    mixed = _run(200, per_s=100.0, chunk=8, frames=800, frame_per_s=400.0)
    rate = estimate.fleet_rate([images, mixed])
    assert rate.frames_measured
    assert rate.image_s == pytest.approx(1 / 100)
    assert rate.frame_s == pytest.approx(1 / 400, rel=0.05)
    one = estimate.Shape(chunks=1, slots=1)
    assert estimate.run_time(100, 400, rate, one, loaded=True) == pytest.approx(
        rate.overhead_s + 1.0 + 1.0, abs=0.1
    )
    note = estimate.time_note(estimate.Fleet(1, rate, loaded=True), one, frames=10)
    assert "images/s and" in note and "frames/s a chunk" in note


def test_a_job_s_videos_are_cut_into_frame_chunks_as_a_worker_cuts_them() -> None:
    fleet = estimate.Fleet(1, estimate.FleetRate(None), threads=16, chunk_size=512)
    # 12 videos of 936 frames on 2 prep processes: chunks of 234, one or more a video
    shape = estimate.Shape.of(1000, 936, 12, fleet, prep_processes=2)
    assert (shape.chunks, shape.slots) == (2 + 12, 14)
    # one long video: 4,000 frames in chunks of 512 at most
    assert estimate.Shape.of(0, 4000, 1, fleet, prep_processes=2).chunks == 8


def test_no_run_measured_gives_no_rate_and_says_so() -> None:
    one = estimate.Shape(chunks=1, slots=1)
    rate = estimate.fleet_rate([])
    assert rate.image_s is None and estimate.run_time(10, 0, rate, one, True) is None
    assert "run a small job first" in estimate.time_note(estimate.Fleet(3, rate), one)
    measured = estimate.fleet_rate([_run(80, 10.0, 8)])
    assert "No worker is up" in estimate.time_note(estimate.Fleet(0, measured), one)
    unmeasured = estimate.time_note(estimate.Fleet(2, measured), one, frames=5)
    assert "frames timed as images" in unmeasured


def test_a_tally_counts_frames_and_objects_named_neither(tmp_path: Path) -> None:
    clip = videos.plain(tmp_path / "a.mp4", 60, fps=10).read_bytes()  # 6 s
    image = b"\xff\xd8\xff" + b"0" * 97
    store = {"p/a.mp4": clip, "p/cam": clip, "p/i.jpg": image, "p/raw": image}

    def read(key: str, first: int, last: int) -> bytes:
        return store[key][first : last + 1]

    from kiln.app.jobs.estimate_listing import Listing

    listing = Listing(counted=[Listed(k, len(v)) for k, v in store.items()])
    bounds = estimate.Bounds(100, 1.0, 20, 1 << 20)
    mix = estimate.tally(listing, read, 2.0, bounds, random.Random(0))
    assert (mix.objects, mix.videos) == (4, 2)
    assert mix.frames == pytest.approx(24)  # 12 from a.mp4's header; cam's bytes at its rate
    assert mix.items == 2 + 24


def test_a_worker_s_prep_processes_are_read_from_its_published_capacity() -> None:
    assert estimate.published_prep({"capacity": {"cores": 8, "prep_processes": 6}}) == 6
    assert estimate.published_prep({"capacity": {"prep_processes": 0}}) == 0  # inline prep
    assert estimate.published_prep({"models": {}}) is None  # an older worker's facts
    assert estimate.published_prep(None) is None
    assert estimate.published_prep({"capacity": {"prep_processes": "auto"}}) is None


def test_the_busiest_a_run_kept_up_is_its_whole_work_not_its_tail() -> None:
    # 4 chunks of 100 at once at 100 items/s each (1 s), then one straggler alone for 2 s:
    # the tail (its steady window) runs 1 chunk at once; the run did 600 items in 2 s, 3 slots'
    # work at 100 items/s a slot
    start = T0.timestamp() + 1.0
    spans = [Span(start, start + 1.0, 100) for _ in range(4)] + [Span(start, start + 2.0, 200)]
    finished = T0 + timedelta(seconds=3.5)
    rate = estimate.fleet_rate([Run("r", spans, [], T0, finished)])
    assert rate.image_s == pytest.approx(1 / 100)
    assert rate.slots_measured == pytest.approx(3.0)
