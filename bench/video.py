"""video: Kiln's video input against a plain PyAV loop, on a generated 720p H.264 clip.

The clip (made once, cached under the work folder): 1280×720, 30 fps, `--video-seconds` long
(600; 20 `--quick`), H.264 by PyAV's libx264 at preset `veryfast` and x264's own GOP (keyint
250, keyint_min 25, scene cuts on), frame threads as FFmpeg's command line encodes (one slice
per frame, not PyAV's sliced threads). Each frame: a textured background that pans, eight
shapes that move, the frame's number drawn large, and a film grain that changes every frame —
so it compresses like footage (a few Mbit/s), not like a test card, and decoding costs what
real video costs. The clip's facts (bitrate, keyframes, x264's settings) go into `extra`.

Each row runs one model at one sampling rate, twice, back to back:

- `video-peer`: what a PyAV user writes: `av.open`, `for frame in container.decode(video=0)`
  with PyAV's defaults (no `thread_type`), the frame shown at t = k/N taken as the last whose
  presentation time (from the first frame's) is ≤ t — every frame for N = 0 — converted to
  the model's input with Kiln's own prep (`decoded_frame`, then the family's
  `prepare_decoded`), run in batches of 16 (Kiln's batch on a CPU) through Kiln's own batch
  half (`PhashPredictor`; the built-in `DetectorPredictor` on ONNX Runtime), one process.
- `video-kiln`: `kiln run CLIP --model M --video-fps N -o OUT`, a fresh data folder each time;
  every row of its Parquet must have succeeded, and there must be as many as the sampling
  gives, or the row is a failure, not a rate. Its phashes are checked against the peer's.

Both are timed as a user times a command: the whole process, interpreter start-up, imports
and model load included, wall-clock, with the CPU (`wait4`) and peak RSS (the process tree,
sampled every 0.2 s) of each. The rate is sampled frames per second.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from bench.measure import Meter
from bench.models import DETECTOR, MAX_PIXELS
from bench.results import CaseResult
from devstack.services import kiln_command, service_env

if TYPE_CHECKING:
    from bench.context import Context

SIZE = (1280, 720)
FPS = 30
PRESET = "veryfast"
GRAIN = 20  # film grain: each pixel gains 0–20 levels, a new pattern every frame (of 8)
MARGIN = 160  # background pixels beyond each edge, for the pan
MODELS = ("phash", DETECTOR)
RATES = (1.0, 0.0)  # sampled frames per second of video; 0: every frame
EPS = 1e-6  # seconds: a frame at t + EPS still counts as shown at t (timestamp rounding)
BATCH = 16  # Kiln's batch on a CPU (KILN_MAX_BATCH auto: config.CPU_BATCH)
CASES = ("video-peer", "video-kiln")


# ---- the clip --------------------------------------------------------------------------------


def clip_path(folder: Path, seconds: float, size: tuple[int, int] = SIZE) -> Path:
    return folder / f"clip-{size[0]}x{size[1]}-{FPS}fps-{seconds:g}s-{PRESET}.mp4"


def make_clip(folder: Path, seconds: float, size: tuple[int, int] = SIZE) -> Path:
    """The clip, made once and reused (its name carries its size, length and preset; it is
    written beside and renamed, so an interrupted run leaves no half clip behind)."""
    path = clip_path(folder, seconds, size)
    if path.exists():
        return path
    import av

    folder.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part.mp4")
    with av.open(str(part), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        # Frame threads, as `ffmpeg` encodes: one slice per frame. (PyAV's default, slice
        # threads, makes x264 cut each frame into slices a decoder could share out.)
        stream.codec_context.thread_type = "AUTO"
        stream.options = {"preset": PRESET}  # x264's own GOP, rate control (CRF 23), B-frames
        for pixels in frames(round(seconds * FPS), size):
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    part.replace(path)
    return path


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def frames(count: int, size: tuple[int, int], seed: int = 7) -> Iterator[np.ndarray]:
    """`count` RGB frames: a panning texture (gradients and blurred noise), moving shapes, the
    frame number large, and grain. Deterministic: the same frames for the same seed."""
    width, height = size
    rng = np.random.default_rng(seed)
    margin = min(MARGIN, width // 4)
    y, x = np.mgrid[0 : height + 2 * margin, 0 : width + 2 * margin].astype(np.float32)
    layers = [
        np.sin(x / rng.uniform(25, 80) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(30, 90)) * 55
        + rng.uniform(90, 170)
        for _ in range(3)
    ]
    texture = np.stack(layers, axis=-1) + rng.normal(0, 10, (*x.shape, 3))
    background = Image.fromarray(np.clip(texture, 0, 255 - GRAIN).astype(np.uint8))
    backdrop = np.asarray(background.filter(ImageFilter.GaussianBlur(0.8)))
    shapes = [
        (
            rng.uniform(0, width), rng.uniform(0, height), rng.uniform(-9, 9), rng.uniform(-7, 7),
            int(rng.integers(width // 20, width // 5)),
            int(rng.integers(height // 18, height // 4)),
            tuple(int(c) for c in rng.integers(0, 255 - GRAIN, 3)), bool(rng.random() < 0.5),
        )
        for _ in range(8)
    ]  # fmt: skip
    grains = [rng.integers(0, GRAIN + 1, (height, width, 3), dtype=np.uint8) for _ in range(8)]
    font, light = _font(height // 3), (255 - GRAIN,) * 3
    for i in range(count):
        t = i / FPS
        dx = int(margin + margin * 0.9 * math.sin(t * 0.37))
        dy = int(margin + margin * 0.9 * math.sin(t * 0.23 + 1))
        image = Image.fromarray(backdrop[dy : dy + height, dx : dx + width])
        draw = ImageDraw.Draw(image)
        for x0, y0, vx, vy, w, h, colour, ellipse in shapes:
            left, top = (x0 + vx * i) % (width + w) - w, (y0 + vy * i) % (height + h) - h
            (draw.ellipse if ellipse else draw.rectangle)([left, top, left + w, top + h], colour)
        draw.text(
            (width // 10, height // 4), str(i), fill=light, font=font,
            stroke_width=max(1, height // 120), stroke_fill=(0, 0, 0),
        )  # fmt: skip
        pixels = np.array(image)
        np.add(pixels, grains[i % len(grains)], out=pixels)  # no overflow: all ≤ 255 − GRAIN
        yield pixels


def clip_facts(path: Path) -> dict[str, Any]:
    """What the clip is, from its packets (none decoded) and x264's own settings line."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.time_base is not None  # an MP4 stream has one
        base = float(stream.time_base)
        stamps, keys = [], []
        for packet in container.demux(stream):
            if packet.pts is None:
                continue
            stamps.append(packet.pts)
            if packet.is_keyframe:
                keys.append(packet.pts)
        width, height = stream.codec_context.width, stream.codec_context.height
    order = sorted(stamps)
    rank = {pts: i for i, pts in enumerate(order)}
    key_frames = sorted(rank[k] for k in keys)
    gaps = np.diff([*key_frames, len(order)])  # frames from each keyframe to the next (or end)
    seconds = (order[-1] - order[0]) * base + 1 / FPS if order else 0.0
    return {
        "file": path.name,
        "size": f"{width}x{height}",
        "fps": FPS,
        "frames": len(order),
        "seconds": round(seconds, 3),
        "mbit_per_s": round(path.stat().st_size * 8 / max(seconds, 1e-9) / 1e6, 2),
        "keyframes": len(key_frames),
        "gop_frames_mean": round(float(np.mean(gaps)), 1) if len(gaps) else 0.0,
        "gop_frames_max": int(np.max(gaps)) if len(gaps) else 0,
        "x264": _x264_settings(path),
    }


def _x264_settings(path: Path) -> str:
    """The GOP and rate-control fields of the settings x264 writes into its first frame."""
    head = path.read_bytes()[: 1 << 20]
    start = head.find(b"x264 - core")
    if start < 0:
        return ""
    line = head[start : head.find(b"\x00", start)].decode("ascii", "replace")
    wanted = ("keyint", "keyint_min", "scenecut", "bframes", "ref", "rc", "crf", "sliced_threads")
    fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
    return " ".join(f"{k}={fields[k]}" for k in wanted if k in fields)


# ---- sampling, as the peer does it -----------------------------------------------------------


def sampled(decoded: Iterator[Any], fps: float, frame_s: float) -> Iterator[tuple[float, Any]]:
    """(moment, frame) for each sampled moment, from frames in presentation order: every frame
    (at its own time) for fps 0; else at each t = k/fps before the video's end (its last
    frame's time plus one frame) the last frame whose time, from the first frame's, is ≤ t."""
    first: float | None = None
    shown: tuple[float, Any] | None = None
    k = 0
    for frame in decoded:
        stamp = float(frame.pts * frame.time_base)
        first = stamp if first is None else first
        t = stamp - first
        if fps <= 0:
            yield t, frame
            continue
        while shown is not None and k / fps < t - EPS:  # the moment falls before this frame
            yield k / fps, shown[1]
            k += 1
        shown = (t, frame)
    if fps > 0 and shown is not None:
        end = shown[0] + frame_s
        while k / fps < end - EPS:
            yield k / fps, shown[1]
            k += 1


def expected_samples(frame_count: int, fps: float) -> int:
    """The moments sampling gives for a clip of `frame_count` frames at FPS: every frame, or
    one at each k/fps before its end (as Kiln's `kiln.app.video.sample_count`)."""
    if fps <= 0:
        return frame_count
    return max(1, math.ceil(frame_count / FPS * fps - 1e-9))


# ---- the peer (in a fresh interpreter: bench.child runs bench.cases.video.measure) -----------


def _predictor(model: str) -> Any:
    """Kiln's own batch half of `model`, as its loader builds it on a CPU."""
    if model == "phash":
        from kiln.workers.models.phash import PhashPredictor

        return PhashPredictor(max_pixels=MAX_PIXELS)
    from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
    from kiln.workers.models import detect

    engine = OnnxRuntimeEngine(detect.model_path(), max_batch=BATCH)
    return detect.DetectorPredictor(engine, max_pixels=MAX_PIXELS, gpu_decode=False)


def peer(args: dict[str, Any]) -> CaseResult:
    """The plain PyAV loop over the clip: sample, prepare with Kiln's prep, run in batches."""
    import av

    from kiln.workers.models.base import Batch
    from kiln.workers.prep.spec import FrameModePrep, FramePrep, build
    from kiln.workers.prep.video import decoded_frame

    started = time.perf_counter()
    model, fps = str(args["model"]), float(args["fps"])
    predictor = _predictor(model)
    prep = build(predictor.prep)
    mode = prep.frame_mode if isinstance(prep, FrameModePrep) else "RGB"
    assert isinstance(prep, FramePrep)  # the image families take decoded frames
    layout, width = predictor.prep.layout, predictor.prep.meta_width
    slots = np.zeros((BATCH, *layout.shape), layout.dtype)
    metas = np.zeros((BATCH, width), np.float32)
    answers: dict[str, Any] = {}
    moments: list[float] = []
    loaded = time.perf_counter() - started

    def run(rows: int) -> None:
        got = predictor.infer(Batch(slots[:rows].copy(), metas[:rows].copy()))
        column = next(iter(got.columns.values())).to_pylist()
        for t, value in zip(moments[-rows:], column, strict=True):
            answers[f"{t:.3f}"] = value

    with Meter({"subject": [os.getpid()]}).window() as usage, av.open(args["clip"]) as container:
        stream = container.streams.video[0]
        frame_s = 1 / float(stream.average_rate or FPS)
        want: tuple[int, int] | None = None
        filled = 0
        for t, frame in sampled(container.decode(video=0), fps, frame_s):
            want = want or prep.frame_size(frame.width, frame.height)
            metas[filled] = 0
            decoded = decoded_frame(frame, want, mode)
            prep.prepare_decoded(decoded, slots[filled], metas[filled])
            moments.append(t)
            filled += 1
            if filled == BATCH:
                run(filled)
                filled = 0
        if filled:
            run(filled)
    Path(args["answers"]).write_text(json.dumps(answers))
    extra = {"load_s": round(loaded, 3), "thread_type": str(stream.thread_type), "batch": BATCH}
    return CaseResult.from_usage("video-peer", str(args["label"]), len(moments), usage, extra=extra)


# ---- one row: the peer, then Kiln, each a whole command --------------------------------------


@dataclass(frozen=True)
class Row:
    model: str
    fps: float
    seconds: float

    @property
    def label(self) -> str:
        rate = "every frame" if self.fps <= 0 else f"{self.fps:g} fps"
        return f"{self.model} {rate}, {self.seconds:g} s clip"

    @property
    def slug(self) -> str:
        rate = "all" if self.fps <= 0 else f"{self.fps:g}fps"
        return f"{self.model}-{rate}-{self.seconds:g}s"


def rows(plan: Any) -> list[Row]:
    """phash and the detector, at 1 fps and at every frame; the detector at every frame on its
    own, shorter clip (`detector_every_frame_seconds`): at 20–30 frames/s on two cores a whole
    long clip would take most of the run."""
    made = []
    for model in MODELS:
        for fps in RATES:
            seconds = plan.video_seconds
            if model == DETECTOR and fps <= 0:
                seconds = min(seconds, plan.detector_every_frame_seconds)
            made.append(Row(model, fps, seconds))
    return made


def clip_for(ctx: Context, row: Row) -> Path:
    return make_clip(ctx.workdir / "videos", row.seconds, ctx.plan.video_size)


@dataclass(frozen=True)
class Timed:
    seconds: float
    cpu_s: float
    peak_rss_mb: float


def _timed(command: list[str], env: dict[str, str], log: Path) -> Timed:
    """Run `command` to its end: wall seconds, CPU of it and its reaped children, peak RSS of
    its process tree. A non-zero exit raises, naming the log."""
    with log.open("wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        with Meter({"subject": [proc.pid]}).window() as usage:
            _pid, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{command[2]} … exited {code}; see {log}:\n{tail}")
    return Timed(
        round(usage.seconds, 3),
        round(rusage.ru_utime + rusage.ru_stime, 3),
        usage.peak_rss_mb.get("subject", 0.0),
    )


def _result(case: str, row: Row, items: int, timed: Timed, extra: dict[str, Any]) -> CaseResult:
    return CaseResult(
        case,
        row.label,
        items=items,
        seconds=timed.seconds,
        cpu_seconds={"subject": timed.cpu_s},
        peak_rss_mb={"subject": timed.peak_rss_mb},
        extra={"fps": row.fps, "clip_seconds": row.seconds, **extra},
    )


def _folder(ctx: Context, row: Row, case: str) -> Path:
    folder = ctx.workdir / "video" / f"{case}-{row.slug}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def run_peer(ctx: Context, row: Row) -> CaseResult:
    """The peer over the row's clip, as `python -m bench.child video …`, timed from outside."""
    clip = clip_for(ctx, row)
    facts = clip_facts(clip)
    folder = _folder(ctx, row, "video-peer")
    args = {
        "model": row.model, "label": row.label, "fps": row.fps, "clip": str(clip),
        "answers": str(folder / "answers.json"),
    }  # fmt: skip
    args_file, out = folder / "args.json", folder / "result.json"
    args_file.write_text(json.dumps(args))
    command = [sys.executable, "-m", "bench.child", "video", str(args_file), str(out)]
    timed = _timed(command, dict(os.environ), ctx.log_dir / f"video-peer-{row.slug}.log")
    inner = json.loads(out.read_text())
    expected = expected_samples(facts["frames"], row.fps)
    if inner["items"] != expected:
        raise RuntimeError(f"the peer sampled {inner['items']} frames, not {expected}")
    extra = {
        "expected_samples": expected,
        "loop_s": inner["seconds"],  # inside the peer: open → last batch, model loaded before
        "clip": facts,
        **inner["extra"],
    }
    return _result("video-peer", row, expected, timed, extra)


def run_kiln(ctx: Context, row: Row) -> CaseResult:
    """`kiln run CLIP --model M --video-fps N` into a fresh data folder: every sampled frame
    must have succeeded; the phashes must be the peer's where the peer ran first."""
    clip = clip_for(ctx, row)
    frames_in_clip = clip_facts(clip)["frames"]
    folder = _folder(ctx, row, "video-kiln")
    env = service_env({**dict(ctx.plan.kiln_env), "KILN_DATA_DIR": str(folder / "data")})
    output = folder / "results.parquet"
    fps = f"{row.fps:g}"
    command = kiln_command("run", str(clip), "--model", row.model, "--video-fps", fps, "-o",
                           str(output))  # fmt: skip
    timed = _timed(command, env, ctx.log_dir / f"video-kiln-{row.slug}.log")
    expected = expected_samples(frames_in_clip, row.fps)
    table = pq.read_table(output)
    statuses = table.column("status").to_pylist()
    succeeded = statuses.count("succeeded")
    if len(statuses) != expected or succeeded != expected:
        errors = [e for e in table.column("error").to_pylist() if e][:3]
        raise RuntimeError(
            f"kiln run: {succeeded} of {len(statuses)} rows succeeded, {expected} expected"
            + (f"; first errors: {errors}" if errors else "")
        )
    extra: dict[str, Any] = {"expected_samples": expected}
    peer_answers = ctx.workdir / "video" / f"video-peer-{row.slug}" / "answers.json"
    if row.model == "phash" and peer_answers.exists():
        extra["phash_same_as_peer"] = _agreement(table, json.loads(peer_answers.read_text()))
    return _result("video-kiln", row, expected, timed, extra)


def _agreement(table: Any, peer: dict[str, str]) -> float:
    """The share of Kiln's frames whose phash is the peer's for the same moment."""
    times = table.column("frame_time_s").to_pylist()
    hashes = table.column("phash").to_pylist()
    same = sum(peer.get(f"{t:.3f}") == h for t, h in zip(times, hashes, strict=True))
    return round(float(same) / max(1, len(times)), 4)


def make_clips(ctx: Context) -> list[CaseResult]:
    """Every clip the rows need, made (or found) before anything is timed; no rows of its own."""
    for row in {r.seconds: r for r in rows(ctx.plan)}.values():
        clip_for(ctx, row)
    return []
