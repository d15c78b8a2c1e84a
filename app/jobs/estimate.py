"""An estimate before running: what a bulk job over a source would hold and take, with no job
created and nothing written (`POST /v1/jobs/estimate`, `kiln bulk --dry-run`).

- What: the source listed, or sampled when huge (`estimate_listing`); images and videos told
  apart by name, and by their first bytes where the name says neither, as a worker would
  (`estimate_videos`); a video's items are the frames the job's `video_fps` samples, from the
  headers of a sample of videos (frames per byte carried to the rest), else from bytes.
- How long: the fleet's measured pace for the model, per chunk slot (a worker's task thread
  running a chunk). Each of the model's recent completed jobs gives its items worked over the
  second half of its writes (`steady`: its first chunks carry the model's loading and a cold
  start), images and frames apart, in chunk-seconds (its chunk runs' spans), and its fixed
  costs: before its first lease and after its last write (listing, queueing, the close), and
  what loading the model added. An image costs Σ chunk-seconds ÷ Σ images over the runs
  without frames; a frame, what the runs with frames took beyond their images ÷ their frames
  (where only one kind ran, both cost the same). A job of k chunks runs min(k, task threads ×
  workers alive) at once, in rounds: its time is the median fixed cost (+ the loading, when no
  worker alive has the model loaded) + rounds × its work ÷ k × the stretch. So n workers take
  n times the chunks at once (each its own cores or device); 0 workers alive → no time.
- The stretch: a worker's throughput saturates (its cores, its process's interpreter, the
  store it reads), and a pace measured at c chunks at once says nothing of where. So a worker
  is taken to do no more work at once than the busiest measured run did (its items over its
  whole work, in slots at the measured costs: `busiest`) or one chunk per prep process,
  whichever is more: a job running more chunks at once a worker has each chunk's pace fall
  in proportion, its items/s held at what was reached (the note says it extrapolates).
"""

from __future__ import annotations

import math
import os
import random
import statistics
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.db import model_runs, worker_facts
from kiln.app.db.models import utcnow
from kiln.app.jobs import estimate_listing as listing
from kiln.app.jobs import estimate_videos as videos
from kiln.app.jobs import throughput
from kiln.app.jobs.estimate_listing import Listed, Listing
from kiln.app.jobs.ingest import BulkRequest, check_bulk
from kiln.app.video import DEFAULT_FPS, FPS_OPTION

LIVE_FOR_S = 30.0  # a worker seen this recently is alive (the fleet page's rule)
RUNS_SINCE = timedelta(days=7)  # older jobs ran on another fleet, likely
RUNS_READ = 10
WARM_SHARE = 0.25  # a steady window shorter than this share of the run: too few chunks
HEAD_SAMPLES = 20  # objects named neither image nor video whose first bytes are read


@dataclass(frozen=True)
class Estimate:
    objects: int
    bytes: int
    images: int  # objects not videos: each one item (an image, or one that fails as none)
    videos: int
    frames: int | None
    items: int
    sampled: bool
    listed: int
    rate_per_s: float | None
    workers: int
    seconds: float | None
    note: str


@dataclass(frozen=True)
class FleetRate:
    """What an item costs one chunk slot (a worker's task thread running a chunk), in
    seconds, from the model's recent runs — an image (any item not a frame) and a video's
    frame apart (a frame needs no fetch of its own) — and a job's fixed seconds: `overhead_s`
    every job pays (listing and queueing before its first lease, its close after its last
    write), `warm_s` what loading the model added."""

    image_s: float | None  # None: no run measured
    frame_s: float | None = None
    overhead_s: float = 0.0
    warm_s: float = 0.0
    jobs: int = 0
    frames_measured: bool = False  # False: frames are costed as images
    slots_measured: float = 0.0  # the most slots' work at once a run kept up (`busiest`)

    def work_s(self, images: float, frames: float) -> float | None:
        """Slot-seconds for these items."""
        if self.image_s is None or self.frame_s is None:
            return None
        return images * self.image_s + frames * self.frame_s


@dataclass(frozen=True)
class Steady:
    """A run's items worked at full speed (`images` and `frames` in `slot_s` chunk-seconds
    over `seconds`), its fixed seconds, and all its items over its whole work (`worked_s`,
    first lease to last write)."""

    images: float
    frames: float
    slot_s: float
    seconds: float
    overhead_s: float
    warm_s: float
    all_images: float = 0.0
    all_frames: float = 0.0
    worked_s: float = 0.0


def steady(run: model_runs.Run) -> Steady | None:
    """The run over the second half of its writes (from halfway between its first chunk's
    write and its last, to its last): a worker's first chunks carry the model's loading, and
    its first jobs a cold start (processes, connections), which a warm fleet does not pay per
    item. Each chunk run's items count as worked evenly over it (`throughput`). A run too short
    for that window (one round of chunks) is taken whole, from its first lease."""
    first_start = min(s.start for s in run.spans)
    first_end = min(s.end for s in run.spans)
    last_end = max(s.end for s in run.spans)
    worked_s = last_end - first_start
    low = first_start
    if last_end - first_end >= WARM_SHARE * worked_s and last_end > first_end:
        low = (first_end + last_end) / 2
    if last_end <= low:
        return None
    items = throughput.worked(run.spans, low, last_end)
    frames = throughput.worked(run.frame_spans, low, last_end)
    slot_s = sum(max(0.0, min(last_end, s.end) - max(low, s.start)) for s in run.spans)
    if items <= 0 or slot_s <= 0:
        return None
    rate = items / (last_end - low)
    overhead = max(0.0, run.wall_s - worked_s)  # before the first lease, after the last write
    warm = max(0.0, worked_s - run.items / rate)
    all_frames = float(sum(s.items for s in run.frame_spans))
    return Steady(
        items - frames, frames, slot_s, last_end - low, overhead, warm,
        run.items - all_frames, all_frames, worked_s,
    )  # fmt: skip


def fleet_rate(runs: list[model_runs.Run]) -> FleetRate:
    """What an image and a frame cost a chunk slot, over the runs' steady windows: an image's
    from the runs without frames, a frame's from what the others took beyond their images;
    frames cost as images where no run had any."""
    found = [one for run in runs if (one := steady(run)) is not None]
    if not found:
        return FleetRate(None)
    image_s, frame_s = _costs(found)
    return FleetRate(
        image_s,
        frame_s,
        statistics.median(f.overhead_s for f in found),
        statistics.median(f.warm_s for f in found),
        len(found),
        frames_measured=any(f.frames for f in found),
        slots_measured=max(busiest(f, image_s, frame_s) for f in found),
    )


def busiest(run: Steady, image_s: float, frame_s: float) -> float:
    """How many chunk slots' work, at the measured costs, the run kept going at once: over its
    whole work (first lease to last write), its items ÷ that time in slots at the measured
    pace, or the chunks at once of its steady window where more (a run whose loading took
    much of its time). The steady window alone would not do: it is the run's tail, where its
    last chunks run with few others, no measure of what the worker can take."""
    tail = run.slot_s / run.seconds
    if run.worked_s <= 0:
        return tail
    return max(tail, (run.all_images * image_s + run.all_frames * frame_s) / run.worked_s)


def _costs(found: list[Steady]) -> tuple[float, float]:
    """Slot-seconds an image and a frame take."""
    plain = [f for f in found if not f.frames]
    mixed = [f for f in found if f.frames]
    every = sum(f.slot_s for f in found) / sum(f.images + f.frames for f in found)
    if not plain or not mixed:
        return every, every  # one kind measured: the other costs the same
    image_s = sum(f.slot_s for f in plain) / sum(f.images for f in plain)
    beyond = sum(f.slot_s - image_s * f.images for f in mixed)
    frames = sum(f.frames for f in mixed)
    if beyond <= 0:  # the mixed runs were faster than their images alone: no measure of frames
        return image_s, sum(f.slot_s for f in mixed) / sum(f.images + f.frames for f in mixed)
    return image_s, beyond / frames


# How a worker cuts a video's frames into chunks (workers/chunk/expand.py, which the app may
# not import): a video spreads over two chunks per prep process, each of 32 frames or more.
FRAME_CHUNKS_PER_PROCESS = 2
MIN_FRAME_CHUNK = 32


def saturation(rate: FleetRate, prep_processes: int = 1) -> float:
    """Chunks a worker is taken to run at once at the measured pace: what the busiest
    measured run kept up (nothing says a worker can take more), or one a prep process (each
    its own core)."""
    return max(1.0, rate.slots_measured, float(prep_processes))


def stretch(rate: FleetRate, slots: int, workers: int, prep_processes: int = 1) -> float:
    """How much slower each chunk goes when a worker runs `slots ÷ workers` at once: 1 up to
    its saturation, then in proportion (the worker's throughput held at what it was)."""
    if workers <= 0 or slots <= 0:
        return 1.0
    return max(1.0, slots / workers / saturation(rate, prep_processes))


@dataclass(frozen=True)
class Shape:
    """How a job would run on the fleet now: its chunks, the slots they take at once, and how
    much slower each chunk goes there than at the measured pace (`stretch`)."""

    chunks: int
    slots: int  # min(chunks, task threads × workers)
    stretch: float = 1.0

    @classmethod
    def of(
        cls, images: float, frames: float, videos: float, fleet: Fleet, prep_processes: int = 1
    ) -> Shape:
        """Bulk chunks of images, and each video's frames in chunks of about frames ÷ (2 ×
        prep processes), 32 to a bulk chunk, as a worker cuts them."""
        chunks = math.ceil(images / fleet.chunk_size)
        if frames:
            spread = FRAME_CHUNKS_PER_PROCESS * max(1, prep_processes)
            size = min(fleet.chunk_size, max(MIN_FRAME_CHUNK, math.ceil(frames / spread)))
            chunks += max(math.ceil(videos), math.ceil(frames / size))
        chunks = max(1, chunks)
        slots = min(chunks, fleet.threads * fleet.workers)
        return cls(chunks, slots, stretch(fleet.rate, slots, fleet.workers, prep_processes))


def run_time(
    images: float, frames: float, rate: FleetRate, shape: Shape, loaded: bool
) -> float | None:
    """Seconds a job of `images` and `frames` takes, submission to close: its chunks in
    rounds of `shape.slots` at once, each at the measured cost per item × the shape's stretch
    (`loaded`: a worker alive has the model loaded already, so no job pays its loading)."""
    work = rate.work_s(images, frames)
    if work is None or shape.slots <= 0:
        return None
    fixed = rate.overhead_s + (0.0 if loaded else rate.warm_s)
    rounds = math.ceil(shape.chunks / shape.slots)
    return round(fixed + rounds * shape.stretch * work / shape.chunks, 1)


@dataclass(frozen=True)
class Fleet:
    workers: int
    rate: FleetRate
    loaded: bool = False  # some worker alive has the model loaded
    threads: int = 16  # chunks in flight per worker (KILN_WORKER_CONCURRENCY)
    chunk_size: int = 512  # a bulk job's chunk (KILN_BULK_CHUNK_SIZE)
    prep_processes: int = 1  # a worker's (KILN_PREP_PROCESSES; `auto` as on this host)


def read_fleet(session: Session, model: str, settings: Settings) -> Fleet:
    """The workers alive now and the model's measured rate (one short read; no lock). Task
    threads and chunk size are this deployment's settings, which its workers share; prep
    processes, the fewest a worker alive publishes (its facts' `capacity`), else as this
    host's cores would give."""
    now = utcnow()
    alive = worker_facts.seen_since(session, now - timedelta(seconds=LIVE_FOR_S))
    loaded = any(model in (row.facts or {}).get("models", {}) for row in alive)
    runs = model_runs.recent_runs(session, model, now - RUNS_SINCE, RUNS_READ)
    rate = fleet_rate(runs)
    published = [prep for row in alive if (prep := published_prep(row.facts)) is not None]
    prep = min(published) if published else settings.prep_count(os.cpu_count() or 1)
    return Fleet(len(alive), rate, loaded, settings.task_threads, settings.bulk_chunk_size, prep)


def published_prep(facts: dict[str, Any] | None) -> int | None:
    """A worker's prep processes as it publishes them (None: an older worker's facts)."""
    value = ((facts or {}).get("capacity") or {}).get("prep_processes")
    return value if isinstance(value, int) and value >= 0 else None


def check(session: Session, request: BulkRequest) -> tuple[str, dict[str, Any]]:
    """The request as a submission would take it (model, source, options, allowed buckets):
    its model's ref and checked options, or the submission's own 4xx sentence."""
    model, options = check_bulk(session, request)
    return model.ref, options


@dataclass(frozen=True)
class Bounds:
    max_objects: int
    budget_s: float
    video_samples: int
    header_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> Bounds:
        return cls(
            settings.estimate_max_objects,
            settings.estimate_budget_s,
            settings.estimate_video_samples,
            settings.estimate_header_bytes,
        )


def estimate(
    request: BulkRequest,
    options: dict[str, Any],
    fleet: Fleet,
    s3_client: Any,
    bounds: Bounds,
    rng: random.Random | None = None,
) -> Estimate:
    """List (or sample) the source and read a sample of its videos' headers, then time it."""
    rng = rng or random.Random()  # noqa: S311 - a sample, not a secret
    source = request.source
    lister = listing.s3_lister(s3_client, source.bucket, source.uri)
    listed = listing.list_source(lister, source, bounds.max_objects, bounds.budget_s, rng)
    reads = videos.s3_ranges(s3_client, source.bucket)
    fps = float(options.get(FPS_OPTION, DEFAULT_FPS))
    mix = tally(listed, reads, fps, bounds, rng)
    images = mix.objects - mix.videos
    shape = Shape.of(images, mix.frames, mix.videos, fleet, fleet.prep_processes)
    seconds = run_time(images, mix.frames, fleet.rate, shape, fleet.loaded)
    work = fleet.rate.work_s(images, mix.frames)
    rate = mix.items * shape.slots / shape.stretch / work if work and fleet.workers else None
    return Estimate(
        objects=round(mix.objects),
        bytes=round(mix.bytes),
        images=round(mix.objects - mix.videos),
        videos=round(mix.videos),
        frames=round(mix.frames) if mix.videos else None,
        items=mix.items,
        sampled=not listed.complete,
        listed=listed.listed,
        rate_per_s=round(rate, 2) if rate else None,
        workers=fleet.workers,
        seconds=seconds,
        note=" ".join(n for n in (listed.note, mix.note, time_note(fleet, shape, mix.frames)) if n),
    )


def time_note(fleet: Fleet, shape: Shape, frames: float = 0.0) -> str:
    rate = fleet.rate
    if rate.image_s is None or rate.frame_s is None:
        return (
            "No completed job of this model in the last 7 days to measure a rate from: "
            "run a small job first for a time."
        )
    if fleet.workers == 0:
        return "No worker is up (none seen in the last 30 s): no time until one starts."
    loading = (
        "" if fleet.loaded or not rate.warm_s else f", + {rate.warm_s:.0f} s to load the model"
    )
    if not frames:
        per = f"{1 / rate.image_s:.3g} items/s a chunk"
    elif rate.frames_measured:
        per = f"{1 / rate.image_s:.3g} images/s and {1 / rate.frame_s:.3g} frames/s a chunk"
    else:
        per = (
            f"{1 / rate.image_s:.3g} items/s a chunk, frames timed as images (no run of this "
            "model with videos to measure them by)"
        )
    more = ""
    if shape.stretch > 1.0:
        at_once = shape.slots / fleet.workers
        more = (
            f" Extrapolated: the busiest measured job kept about {rate.slots_measured:.1f} "
            f"chunks' work going at once and this one would run {at_once:.3g} a worker; a "
            "worker's throughput is taken as saturated beyond "
            f"{saturation(rate, fleet.prep_processes):.3g} at once, so each chunk's pace falls "
            f"{shape.stretch:.2g}×, too slow where chunks wait on I/O rather than on the "
            "worker's cores."
        )
    return (
        f"Time: {per}, measured over the model's last {rate.jobs} completed "
        f"job{'s' if rate.jobs != 1 else ''}; {shape.chunks:,} chunk"
        f"{'s' if shape.chunks != 1 else ''}, {shape.slots} at once on {fleet.workers} worker"
        f"{'s' if fleet.workers != 1 else ''} alive; + {rate.overhead_s:.0f} s a job's fixed "
        f"cost (listing, queueing, the close){loading}.{more}"
    )


@dataclass(frozen=True)
class Mix:
    objects: float
    bytes: float
    videos: float
    frames: float
    note: str

    @property
    def items(self) -> int:
        return round(self.objects - self.videos + self.frames)


def tally(
    listed: Listing, reads: videos.RangeReader, fps: float, bounds: Bounds, rng: random.Random
) -> Mix:
    """The listing's weighted totals, with its videos' frames."""
    objects = size = 0.0
    named: list[tuple[Listed, float]] = []
    unknown: list[tuple[Listed, float]] = []
    for obj, weight in listed.weighted():
        objects += weight
        size += weight * obj.size
        if obj.kind == "video":
            named.append((obj, weight))
        elif obj.kind == "unknown":
            unknown.append((obj, weight))
    found, unknown_note = _videos_among(unknown, reads, rng)
    every = named + found
    count = sum(w for _, w in every)
    if count == 0:
        return Mix(objects, size, 0.0, 0.0, unknown_note)
    frames, frames_note = _frames(every, reads, fps, bounds, rng)
    return Mix(objects, size, count, frames, " ".join(filter(None, (unknown_note, frames_note))))


def _videos_among(
    unknown: list[tuple[Listed, float]], reads: videos.RangeReader, rng: random.Random
) -> tuple[list[tuple[Listed, float]], str]:
    """The videos among objects named neither image nor video, by their first bytes: each of
    up to HEAD_SAMPLES looked into, chosen at random, stands for its share of them all."""
    if not unknown:
        return [], ""
    sample = rng.sample(unknown, min(HEAD_SAMPLES, len(unknown)))
    scale = len(unknown) / len(sample)
    found = [(o, w * scale) for o, w in sample if videos.is_video(reads, o.key, o.size)]
    if len(sample) == len(unknown):
        return found, ""
    return found, (
        f"{len(unknown):,} objects are named neither image nor video: {len(found)} of "
        f"{len(sample)} looked into begin as a video, and each stands for {scale:.3g}."
    )


def _frames(
    named: list[tuple[Listed, float]],
    reads: videos.RangeReader,
    fps: float,
    bounds: Bounds,
    rng: random.Random,
) -> tuple[float, str]:
    """The frames sampled from the videos: the headers of up to `video_samples` of them, their
    frames per byte carried to the rest; from bytes alone where no header could be read."""
    sample = rng.sample(named, min(bounds.video_samples, len(named)))
    read: dict[str, int] = {}
    for obj, _ in sample:
        header = videos.header_of(reads, obj.key, obj.size, bounds.header_bytes)
        frames = videos.sampled_frames(header, fps) if header else None
        if frames is not None:
            read[obj.key] = frames
    rest_bytes = sum(w * o.size for o, w in named if o.key not in read)
    exact = sum(w * read[o.key] for o, w in named if o.key in read)
    if read:
        per_byte = sum(read.values()) / max(1, sum(o.size for o, _ in named if o.key in read))
        if rest_bytes == 0:
            return exact, f"The videos' frames are from their {len(read)} headers."
        note = (
            f"The videos' frames are from {len(read)} headers read, and their frames per byte "
            "for the rest."
        )
        return exact + per_byte * rest_bytes, note
    guess = sum(w * videos.frames_from_bytes(o.size, fps) for o, w in named)
    return float(guess), (
        f"No video header could be read within {bounds.header_bytes:,} bytes: the frames are "
        f"estimated from the videos' bytes at {videos.ASSUMED_BYTES_PER_S * 8 / 1e6:g} Mbit/s."
    )
