"""`gpu` (issue 24, item 6): a GPU benchmark that measures the GPU. How close Kiln's engine and
`kiln run` come to what the card does with ResNet-50 in plain torch, with NVML's busy share
beside every figure, in one run and one process tree.

    python -m bench.gpu --workdir DIR --out FILE.json [--markdown FILE.md] [--images 6000]
        [--seconds 1.5] [--device cuda|cpu] [--skip a,b,...|worker] [--budget 400]

Parts (ResNet-50 with the bench's seed-0 weights, bench/models.py):
a. `native`, the limit: the module in plain torch, FP16 + channels_last (cuDNN autotuned),
   input already on the device, at batch 16, 64 and 256.
b. `engine`: Kiln's torch engine object over the same ResNet-50 exported to ONNX (onnx2fx),
   fed host uint8 NHWC batches as Kiln's prep processes feed it, at every bucket 1…256 with
   CUDA graphs, and at 16/64/256 without; each build (the convert) timed.
c. `kiln`: `kiln run` from 640×480 JPEG bytes, nvJPEG and CPU decode (bench/gpu_feed.py); a
   warm `kiln worker` too where Postgres and Redis answer, else a row says why not.
d. `peer`: a PyTorch DataLoader feeding the plain-torch module (bench/gpu_feed.py).
e. `detector`: Kiln's built-in detector, `kiln run --model detector` over the same JPEGs.

How: a and b time back-to-back calls for `--seconds` after a warm-up (the first call timed
apart: cuDNN autotuning, graph capture), synchronised at the end: images/s = calls × batch /
elapsed. c, d and e are marginal rates over two sizes (a third and all of the images), so
start-up and model load cancel. While each runs, a thread reads NVML's utilisation every 50 ms
(the share of time some kernel ran, not SM occupancy); mean and p50 are over the steady part,
from the first to the last busy sample, so start-up and tear-down with the GPU idle are cut
off. Without NVML (a CPU host) they read "n/a".

Each part runs in a child process under its own time limit (and all within `--budget`), writing
its rows as they come; the JSON and markdown are rewritten after each part, so a stuck part
costs only its own limit and what was measured before it survives. `--device cpu` runs it all
on the CPU at small sizes (the tests); the targets are GPU targets and are not judged there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.gpu_feed import SIDE, Busy, Run, Subject, images, kiln_subject, peer_subject

PARTS = {"a": "native", "b": "engine", "c": "kiln", "d": "peer", "e": "detector"}
STEPS = ("prepare", *PARTS.values())
# Seconds per step on a GPU host; `--budget` caps their sum (the session has ~8 minutes).
TIMEOUT_S = {"prepare": 60, "native": 45, "engine": 120, "kiln": 180, "peer": 45, "detector": 90}
MIN_STEP_S = 10  # with less budget left, a step is skipped rather than started and killed
NATIVE_BATCHES = (16, 64, 256)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# The targets (issue 24): judged on a GPU only.
RATIO_TARGET, RATIO_BATCHES = 0.85, (64, 256)
B16_TARGET = 10_000  # engine, CUDA graphs, batch 16, on an H200
RUN_TARGET, BUSY_TARGET = 8_000, 80.0
DETECTOR_TODAY, DETECTOR_GAIN = 375, 5

Row = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    workdir: Path
    device: str
    images: int
    seconds: float
    max_batch: int
    engine: str  # KILN_ENGINE of the `kiln run`s
    skip: frozenset[str]


# --- pure helpers ---------------------------------------------------------------------------


def steady(samples: list[float]) -> list[float]:
    """From the first to the last busy sample: start-up and tear-down idle the GPU. All idle
    stays all idle (a mean of 0, not n/a)."""
    busy = [i for i, value in enumerate(samples) if value > 0]
    return samples[busy[0] : busy[-1] + 1] if busy else samples


def busy_stats(samples: list[float]) -> dict[str, Any]:
    """Mean and p50 over the steady part; None without samples (no NVML)."""
    part = steady(samples)
    if not part:
        return {"mean": None, "p50": None, "samples": 0}
    mean, p50 = statistics.fmean(part), statistics.median(part)
    return {"mean": round(mean, 1), "p50": round(p50, 1), "samples": len(part)}


def marginal_busy(small: Run, large: Run) -> float | None:
    """NVML's busy share of the marginal seconds: the large run's busy seconds (mean × wall) less
    the small run's, over the difference in wall time, so start-up (the warm-up sweep, which
    busies the GPU too) cancels as it does in the rate. None without samples or a margin."""
    if not (small.sm_busy and large.sm_busy) or large.seconds <= small.seconds:
        return None
    small_s, large_s = (statistics.fmean(r.sm_busy) * r.seconds for r in (small, large))
    return round((large_s - small_s) / (large.seconds - small.seconds), 1)


def buckets(max_batch: int) -> list[int]:
    """Kiln's batch buckets: powers of two up to `max_batch`."""
    return [1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch]


def native_batches(max_batch: int) -> list[int]:
    return sorted({min(b, max_batch) for b in NATIVE_BATCHES})


def parse_skip(text: str) -> frozenset[str]:
    """`a,c` or `native,kiln` (and `worker`: the `kiln worker` subject) → step names."""
    names = {PARTS.get(token.strip(), token.strip()) for token in text.split(",") if token.strip()}
    unknown = names - {*STEPS, "worker"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts {sorted(unknown)}; use a-e or names")
    return frozenset(names)


def row(part: str, subject: str, batch: int | None, rate: float, samples: list[float]) -> Row:
    return {"part": part, "subject": subject, "batch": batch,
            "images_per_s": round(rate, 1), "sm_busy": busy_stats(samples)}  # fmt: skip


def skipped(part: str, subject: str, reason: str, why: str = "skipped") -> Row:
    """A subject not measured: `why` is "skipped" (not run) or "failed"."""
    return {"part": part, "subject": subject, "batch": None, why: reason}


def measured(r: Row) -> bool:
    return "skipped" not in r and "failed" not in r


def annotate(rows: list[Row], device: str) -> list[Row]:
    """Each row with its reference and ratio (engine rows: the native module at the same batch;
    end-to-end rows: the DataLoader peer) and its target, judged only on a GPU."""
    live = [r for r in rows if measured(r)]
    native = {r["batch"]: r["images_per_s"] for r in live if r["part"] == "native"}
    peer = next((r["images_per_s"] for r in live if r["part"] == "peer"), None)
    out = []
    for r in rows:
        ref, base = _reference(r, native, peer)
        ratio = r["images_per_s"] / base if base and measured(r) and "note" not in r else None
        target, met = _target({**r, "ratio": ratio})
        out.append({**r, "reference": ref if ratio is not None else None,
                    "ratio": None if ratio is None else round(ratio, 3),
                    "target": target, "met": met if device == "cuda" else None})  # fmt: skip
    return out


def _reference(r: Row, native: dict[int, float], peer: float | None) -> tuple[str, float | None]:
    if r["part"] == "engine":
        return f"native@{r['batch']}", native.get(r["batch"])
    if r["part"] in ("kiln", "detector"):
        return "peer", peer
    return "", None


def _target(r: Row) -> tuple[str | None, bool | None]:
    """The issue's target for a row, and whether it is met (None: no figure to judge)."""
    live = measured(r)
    rate, ratio, busy = r.get("images_per_s", 0.0), r["ratio"], r.get("sm_busy", {}).get("mean")
    if r["part"] == "engine" and r.get("graphs") is not False:  # None: no graphs switch
        if r["batch"] in RATIO_BATCHES:
            return f"≥ {RATIO_TARGET}× native", (ratio >= RATIO_TARGET) if ratio else None
        if r["batch"] == 16 and r.get("graphs"):
            return f"≥ {B16_TARGET:,} img/s (H200)", rate >= B16_TARGET if live else None
    if r["part"] == "kiln" and r["subject"].startswith("kiln run"):
        met = rate >= RUN_TARGET and (busy or 0) >= BUSY_TARGET
        return f"≥ {RUN_TARGET:,} img/s, SM busy ≥ {BUSY_TARGET:.0f}%", met if live else None
    if r["part"] == "detector":
        goal = DETECTOR_TODAY * DETECTOR_GAIN
        return (
            f"≥ {goal:,} img/s ({DETECTOR_GAIN}× {DETECTOR_TODAY})",
            rate >= goal if live else None,
        )
    return None, None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def table_line(r: Row) -> str:
    batch = "–" if r["batch"] is None else str(r["batch"])
    met = {True: "yes", False: "no", None: "–"}[r.get("met")]
    target = r.get("target") or ""
    for why in ("skipped", "failed"):
        if why in r:
            return f"| {r['subject']} | {batch} | {why}: {r[why]} | | | | {target} | {met} |"
    ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}× {r['reference']}"
    if r["part"] in ("native", "peer"):
        ratio = "reference"
    busy, rate = r["sm_busy"], r["images_per_s"]
    shown = r.get("note") or (f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}")
    figures = f"{shown} | {ratio} | {_pct(busy['mean'])} | {_pct(busy['p50'])}"
    return f"| {r['subject']} | {batch} | {figures} | {target} | {met} |"


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table: one row per subject and batch, a host line above, each
    step's status and the engine's build times below."""
    host = report["host"]
    lines = [
        "## Kiln on the GPU: `python -m bench.gpu`",
        "",
        f"Host: {host['gpu'] or 'no GPU (NVML absent)'} · torch {host['torch']} · "
        f"{host['cores']} cores · device {host['device']} · {host['utc']}",
        "",
        "| subject | batch | images/s | ratio | SM busy mean % | SM busy p50 % | target | met |",
        "|---|--:|--:|--:|--:|--:|---|---|",
    ]
    lines += [table_line(r) for r in all_rows(report)]
    lines += ["", "Steps: " + " · ".join(_step_note(n, p) for n, p in report["parts"].items())]
    facts = report["parts"].get("engine", {}).get("facts", {})
    if facts:
        lines.append("Engine: " + " · ".join(f"{k} {v}" for k, v in facts.items()))
    return "\n".join(lines) + "\n"


def _step_note(name: str, part: dict[str, Any]) -> str:
    status = part["status"]
    if status == "skipped":
        return f"{name} skipped ({part['reason']})"
    return f"{name} {status} {part['seconds']:.0f} s"


def all_rows(report: dict[str, Any]) -> list[Row]:
    rows = [r for part in report["parts"].values() for r in part.get("rows", [])]
    return annotate(rows, report["host"]["device"])


# --- measuring (child processes) ------------------------------------------------------------


class Sink:
    """A part's rows and facts, rewritten to its file after each: a killed part keeps them."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows, self.facts = path, list[Row](), dict[str, Any]()

    def add(self, new: Row) -> None:
        self.rows.append(new)
        self._write()
        print(json.dumps(new), flush=True)

    def fact(self, key: str, value: Any) -> None:
        self.facts[key] = value
        self._write()

    def _write(self) -> None:
        _write_atomic(self.path, json.dumps({"rows": self.rows, "facts": self.facts}, indent=1))


@dataclass
class Timing:
    calls: int
    seconds: float
    first_call_s: float
    samples: list[float]


def timed(call: Callable[[], object], seconds: float, sync: Callable[[], None]) -> Timing:
    """The first call apart (autotuning, graph capture), a third of `seconds` of warm-up, then
    calls for `seconds` under NVML sampling, synchronised once at the end (a queue kept full)."""
    started = time.perf_counter()
    call()
    sync()
    first = time.perf_counter() - started
    warm_until = time.perf_counter() + seconds / 3
    while time.perf_counter() < warm_until:
        call()
    sync()
    with Busy() as busy:
        calls, started = 0, time.perf_counter()
        while calls == 0 or time.perf_counter() - started < seconds:
            call()
            calls += 1
        sync()
        elapsed = time.perf_counter() - started
    return Timing(calls, elapsed, round(first, 3), busy.samples)


def _timed_row(part: str, subject: str, batch: int, timing: Timing) -> Row:
    rate = timing.calls * batch / timing.seconds
    return {**row(part, subject, batch, rate, timing.samples), "first_call_s": timing.first_call_s}


def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def part_native(s: Settings, sink: Sink) -> None:
    import torch

    from bench.models import _resnet

    cuda = s.device == "cuda"
    torch.backends.cudnn.benchmark = True  # the limit: cuDNN picks its fastest kernels
    dtype = torch.float16 if cuda else torch.float32  # FP16 on a CPU is slower, not faster
    torch.manual_seed(0)
    model: Any = _resnet(50).eval()  # Any: torch's Module.to overloads differ by release
    model = model.to(s.device, dtype, memory_format=torch.channels_last)
    subject = f"native torch {'fp16' if cuda else 'fp32'} channels_last"
    with torch.inference_mode():
        for batch in native_batches(s.max_batch):
            x = torch.randn(batch, 3, SIDE, SIDE, device=s.device, dtype=dtype)
            x = x.contiguous(memory_format=torch.channels_last)
            timing = timed(partial(model, x), s.seconds, _sync(s.device))
            sink.add(_timed_row("native", subject, batch, timing))


def build_engine(s: Settings, graphs: bool, runners: int = 1) -> tuple[Any, float, list[str]]:
    """Kiln's torch engine over the ONNX ResNet-50, the seconds its build took, and notes on
    what this tree's engine lacks (then built without it)."""
    from kiln.workers.engines.base import EngineRequest
    from kiln.workers.engines.torch_engine import build_torch_engine, require_torch
    from kiln.workers.engines.uint8_input import Normalization

    notes, kwargs = [], dict[str, Any](runners=runners, precision="auto")
    request_args: dict[str, Any] = {"normalization": Normalization(mean=MEAN, std=STD)}
    if "normalization" not in {f.name for f in fields(EngineRequest)}:
        notes, request_args = ["EngineRequest has no normalization"], {}
    if has_graphs_switch():
        kwargs["graphs"] = graphs
    else:
        notes.append("build_torch_engine has no graphs= (built without)")
    request = EngineRequest("resnet50", onnx_path(s.workdir), s.max_batch, **request_args)
    require_torch()  # imported before the clock starts: the build is the convert, not imports
    started = time.perf_counter()
    engine = build_torch_engine(request, s.device, **kwargs)
    return engine, round(time.perf_counter() - started, 2), notes


def has_graphs_switch() -> bool:
    from kiln.workers.engines.torch_engine import build_torch_engine

    return "graphs" in inspect.signature(build_torch_engine).parameters


def engine_call(engine: Any, batch: int) -> tuple[Callable[[], object], str]:
    """One `infer` over a host uint8 NHWC batch, and how the engine takes it: uint8 itself, or
    (an engine before the uint8 contract) float32 made by its `prepare` step."""
    import numpy as np

    from kiln.workers.engines.uint8_input import Normalization

    spec = engine.inputs[0]
    pixels = np.random.default_rng(batch).integers(0, 256, (batch, SIDE, SIDE, 3), np.uint8)
    feeds = {spec.name: pixels}
    if spec.dtype == "uint8":
        return (lambda: engine.infer(feeds)), "uint8 (the engine normalises)"
    prepare = {spec.name: Normalization(mean=MEAN, std=STD)}
    return (lambda: engine.infer(feeds, prepare)), f"{spec.dtype} via prepare (no uint8 input)"


def _engine_rows(s: Settings, sink: Sink, graphs: bool, batches: Iterable[int]) -> None:
    engine, build_s, notes = build_engine(s, graphs)
    switch = has_graphs_switch()
    sink.fact(f"build_s graphs={graphs}" if switch else "build_s", build_s)
    if notes:
        sink.fact("notes", notes)
    if hasattr(engine, "graphs"):  # whether graphs=True took (a dynamic shape runs eagerly)
        sink.fact(f"replays graphs graphs={graphs}", engine.graphs is not None)
    sink.fact(f"reason graphs={graphs}", getattr(engine, "reason", ""))
    subject = f"engine graphs={graphs}" if switch else "engine (no graphs switch)"
    for batch in batches:
        call, contract = engine_call(engine, batch)
        sink.fact("input", contract)
        timing = timed(call, s.seconds, _sync(s.device))
        new = _timed_row("engine", subject, batch, timing)
        sink.add({**new, "graphs": graphs if switch else None})


WORKER_FED = "engine as a worker feeds it (2 runners, gathered into staging)"


def _worker_fed_rows(s: Settings, sink: Sink) -> None:
    """The engine as a worker drives it: two runner threads, each gathering its batch from an
    array of slots into the engine's staging buffer (`np.take`, as `runtime.gather` does) and
    running it, so one thread's copies overlap the other's work on the GPU."""
    import threading

    import numpy as np

    engine, _seconds, _notes = build_engine(s, True, runners=2)
    if getattr(engine, "host_buffer", None) is None:
        raise RuntimeError("this engine has no staging buffer to gather into")
    name = engine.inputs[0].name
    slots = np.random.default_rng(0).integers(0, 256, (512, SIDE, SIDE, 3), np.uint8)
    for batch in native_batches(s.max_batch):
        counts = [0, 0]

        def run(i: int, until: float, batch: int = batch, counts: list[int] = counts) -> None:
            picks = np.random.default_rng(i).choice(len(slots), batch, replace=False)
            while counts[i] == 0 or time.perf_counter() < until:
                buffer = engine.host_buffer((batch, SIDE, SIDE, 3))
                np.take(slots, picks, axis=0, out=buffer)
                engine.infer({name: buffer})
                counts[i] += 1

        first = time.perf_counter()
        run(0, 0.0)  # warm: each thread's staging is made on its first call
        first = time.perf_counter() - first
        counts[0] = 0
        with Busy(interval=0.05) as busy:
            started = time.perf_counter()
            until = started + s.seconds
            threads = [threading.Thread(target=run, args=(i, until)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            elapsed = time.perf_counter() - started
        rate = sum(counts) * batch / elapsed
        sink.add({**row("engine", WORKER_FED, batch, rate, busy.samples),
                  "first_call_s": round(first, 3)})  # fmt: skip


def part_engine(s: Settings, sink: Sink) -> None:
    first = "engine graphs=True" if has_graphs_switch() else "engine (no graphs switch)"
    attempt(sink, "engine", first, lambda: _engine_rows(s, sink, True, buckets(s.max_batch)))
    _release(s.device)
    attempt(sink, "engine", WORKER_FED, lambda: _worker_fed_rows(s, sink))
    if has_graphs_switch():  # the comparison: the same engine without CUDA graphs
        _release(s.device)
        eager = partial(_engine_rows, s, sink, False, native_batches(s.max_batch))
        attempt(sink, "engine", "engine graphs=False", eager)
    else:
        sink.add(skipped("engine", "engine graphs=False", "this engine has no graphs= switch"))


def _release(device: str) -> None:
    """The first engine's memory (its graphs' pools) back before the second is built."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def part_kiln(s: Settings, sink: Sink) -> None:
    folders = image_folders(s.workdir)
    decodes = ("gpu", "cpu") if s.device == "cuda" else ("cpu",)
    if s.device != "cuda":
        sink.add(skipped("kiln", "kiln run, GPU decode", "no GPU (nvJPEG needs CUDA)"))
    for decode in decodes:
        extra = {"KILN_GPU_DECODE": "true" if decode == "gpu" else "false"}
        name = f"kiln run, {decode.upper()} decode"
        run = partial(kiln_subject, name, s.workdir, onnx_path(s.workdir), folders, extra, s.engine)
        attempt(sink, "kiln", name, partial(_add_subject, sink, "kiln", run))
    name = "kiln worker, CPU decode"
    reason = "--skip worker" if "worker" in s.skip else services_down()
    if reason:
        sink.add(skipped("kiln", name, reason))
    else:
        attempt(sink, "kiln", name, lambda: sink.add(worker_row(s, name, folders[1])))


def _add_subject(sink: Sink, part: str, measure: Callable[[], Subject]) -> None:
    sink.add(_subject_row(part, measure()))


def attempt(sink: Sink, part: str, subject: str, measure: Callable[[], None]) -> None:
    """One subject's measurement; its failure becomes its row (traceback in the part's log),
    and the part's other subjects still run."""
    try:
        measure()
    except Exception as error:
        traceback.print_exc()
        sink.add(skipped(part, subject, f"{type(error).__name__}: {error}"[:300], "failed"))


def worker_row(s: Settings, name: str, large: Path) -> Row:
    """A warm `kiln worker` fed a bulk job: the `feed-worker` case of bench/cases/feed.py, in a
    stack of its own (Postgres, Redis, moto, API)."""
    from bench.cases import feed
    from bench.context import Context
    from bench.models import labels
    from bench.plan import Plan
    from bench.stack import Registered, kiln_stack

    env = (("KILN_CONTENT_CACHE", "false"), ("KILN_ENGINE", s.engine), ("KILN_GPU_DECODE", "false"))
    plan, logs = Plan(kiln_env=env), s.workdir / "worker-logs"
    logs.mkdir(parents=True, exist_ok=True)
    model = Registered("resnet50", onnx_path(s.workdir), SIDE, labels(1000))
    with kiln_stack(logs, dict(env)) as stack, Busy() as busy:
        ctx = Context(plan, s.workdir, logs, images=[], small_images=[], models={}, stack=stack)
        result = feed._worker(ctx, model, sorted(large.iterdir()))
    return {**row("kiln", name, None, result.items_per_s, busy.samples), "runs": result.extra}


def services_down() -> str | None:
    """Why a `kiln worker` cannot run here (Postgres or Redis not answering), or None."""
    try:
        import psycopg
        import redis

        from devstack.services import PG_ADMIN_URL, REDIS_HOST, REDIS_PORT

        psycopg.connect(PG_ADMIN_URL, connect_timeout=2).close()
        with redis.Redis(REDIS_HOST, REDIS_PORT, socket_connect_timeout=2) as client:
            client.ping()
    except Exception as error:  # any failure means the same: no worker here
        return f"Postgres or Redis does not answer ({type(error).__name__}: {error})"[:200]
    return None


def part_peer(s: Settings, sink: Sink) -> None:
    paths = sorted(image_folders(s.workdir)[1].iterdir())
    subject = peer_subject(paths, os.cpu_count() or 1, s.device)
    subject.name = "DataLoader peer"
    sink.add(_subject_row("peer", subject))


def part_detector(s: Settings, sink: Sink) -> None:
    folders = image_folders(s.workdir)
    name = "detector, kiln run"
    subject = kiln_subject(name, s.workdir, None, folders, {}, s.engine, model="detector")
    sink.add(_subject_row("detector", subject))


def _subject_row(part: str, subject: Subject) -> Row:
    """A marginal subject: its rate, busy share over the large run's steady part and at the
    margin, and both runs."""
    small, large = subject.small, subject.large
    runs = {
        size: {"items": run.items, "seconds": run.seconds, "cpu_s": run.cpu_s}
        for size, run in (("small", small), ("large", large))
    }
    new = {**row(part, subject.name, None, subject.rate, large.sm_busy), "runs": runs}
    new["sm_busy_marginal_pct"] = marginal_busy(small, large)
    if large.seconds <= small.seconds:  # tiny sizes: start-up noise outweighs the extra images
        new["note"] = "noise (large run not slower)"
    return new


def part_prepare(s: Settings, sink: Sink) -> None:
    """The JPEGs and their two folders (what c, d and e read), and the ONNX file (b and c)."""
    from bench.inputs import link_folder
    from bench.models import export_resnet

    if {"kiln", "peer", "detector"} - s.skip:
        paths = images(s.workdir / "images", s.images)
        small, large = image_folders(s.workdir)
        link_folder(small, paths[: len(paths) // 3])
        link_folder(large, paths)
        sink.fact("images", len(paths))
    if {"engine", "kiln"} - s.skip:
        started = time.perf_counter()
        export_resnet(50, onnx_path(s.workdir))
        sink.fact("export_s", round(time.perf_counter() - started, 1))


def image_folders(work: Path) -> tuple[Path, Path]:
    return work / "small", work / "large"


def onnx_path(work: Path) -> Path:
    return work / "resnet50.onnx"


PART_FUNCTIONS: dict[str, Callable[[Settings, Sink], None]] = {
    "prepare": part_prepare, "native": part_native, "engine": part_engine,
    "kiln": part_kiln, "peer": part_peer, "detector": part_detector,
}  # fmt: skip


# --- driving (the parent) -------------------------------------------------------------------


def run_step(step: str, s: Settings, timeout: float) -> dict[str, Any]:
    """One part in a child process of its own session, killed with its whole group (the `kiln
    run` trees it started) when `timeout` passes; what it wrote so far is kept."""
    if timeout < MIN_STEP_S:
        return {"status": "skipped", "reason": f"budget spent ({timeout:.0f} s left)"}
    out, log = s.workdir / f"part-{step}.json", s.workdir / f"part-{step}.log"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "bench.gpu", *child_args(s), "--part", step, "--out", str(out)]
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            status = "ok" if proc.wait(timeout) == 0 else "failed"
        except subprocess.TimeoutExpired:
            status = "timeout"
        except SystemExit:  # this driver was told to stop (`timeout`): keep what it wrote
            status = "stopped"
        finally:
            _end_group(proc)
    part = json.loads(out.read_text()) if out.exists() else {"rows": [], "facts": {}}
    part |= {"status": status, "seconds": round(time.monotonic() - started, 1),
             "timeout_s": round(timeout), "log": str(log)}  # fmt: skip
    if status != "ok":
        part["log_tail"] = log.read_text(errors="replace")[-2000:]
    return part


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM then KILL the child's process group (the child is its leader): a part's `kiln run`
    or DataLoader workers must not outlive it and load the next part's GPU."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)


def child_args(s: Settings) -> list[str]:
    args = ["--workdir", str(s.workdir), "--device", s.device, "--images", str(s.images),
            "--seconds", str(s.seconds), "--max-batch", str(s.max_batch),
            "--engine", s.engine]  # fmt: skip
    return [*args, "--skip", ",".join(sorted(s.skip))] if s.skip else args


def host(device: str) -> dict[str, Any]:
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:  # a CUDA image's torch may lack metadata
        torch = "absent"
    utc = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return {"gpu": gpu_name(), "torch": torch, "cores": os.cpu_count(), "device": device,
            "python": platform.python_version(), "utc": utc}  # fmt: skip


def gpu_name() -> str | None:
    """The first GPU's name through NVML (no CUDA context in this process); None without."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML or no GPU: a CPU host
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def drive(
    s: Settings, out: Path, md: Path | None, budget: float, timeouts: dict[str, float]
) -> int:
    s.workdir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)  # the part in flight goes with this driver
    report: dict[str, Any] = {"host": host(s.device), "settings": _settings_dict(s), "parts": {}}
    deadline = time.monotonic() + budget
    for step in STEPS:
        if step in s.skip:
            report["parts"][step] = {"status": "skipped", "reason": "--skip"}
        else:
            left = deadline - time.monotonic()
            report["parts"][step] = run_step(step, s, min(timeouts[step], left))
        print(f"{step}: {report['parts'][step]['status']}", flush=True)
        save(report, out, md)
        if report["parts"][step]["status"] == "stopped":
            return 128 + signal.SIGTERM
    print(markdown(report), flush=True)
    steps_ok = all(p["status"] in ("ok", "skipped") for p in report["parts"].values())
    return 0 if steps_ok and not any("failed" in r for r in all_rows(report)) else 1


def _stop(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def save(report: dict[str, Any], out: Path, md: Path | None) -> None:
    payload = {**report, "rows": all_rows(report)}
    _write_atomic(out, json.dumps(payload, indent=2))
    if md is not None:
        _write_atomic(md, markdown(report))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _settings_dict(s: Settings) -> dict[str, Any]:
    return {**{f.name: getattr(s, f.name) for f in fields(s)}, "workdir": str(s.workdir),
            "skip": sorted(s.skip)}  # fmt: skip


def parse_timeouts(text: str) -> dict[str, float]:
    """`engine=200,kiln=150` over the defaults."""
    pairs = (item.split("=", 1) for item in text.split(",") if item.strip())
    given = {PARTS.get(k.strip(), k.strip()): float(v) for k, v in pairs}
    unknown = set(given) - set(STEPS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown steps {sorted(unknown)}")
    return {**TIMEOUT_S, **given}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the JSON (a part's rows, with --part)")
    p.add_argument("--markdown", type=Path, help="the table, rewritten after each part")
    p.add_argument("--images", type=int, default=6000, help="640×480 JPEGs for c, d and e")
    p.add_argument("--seconds", type=float, default=1.5, help="timed calls per batch in a and b")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--max-batch", type=int, default=256, help="the largest batch of a and b")
    p.add_argument(
        "--engine", help="KILN_ENGINE of the kiln runs (torch-cuda; on a CPU onnxruntime-cpu)"
    )
    p.add_argument("--skip", type=parse_skip, default=frozenset(), help="a-e, names, or worker")
    p.add_argument("--budget", type=float, default=400, help="seconds for all parts together")
    p.add_argument("--timeouts", type=parse_timeouts, default=dict(TIMEOUT_S), help="native=60,…")
    p.add_argument("--part", choices=STEPS, help=argparse.SUPPRESS)  # a child: one part
    return p


def main() -> None:
    args = parser().parse_args()
    engine = args.engine or ("torch-cuda" if args.device == "cuda" else "onnxruntime-cpu")
    s = Settings(
        args.workdir, args.device, args.images, args.seconds, args.max_batch, engine, args.skip
    )
    if args.part:
        PART_FUNCTIONS[args.part](s, Sink(args.out))
        return
    sys.exit(drive(s, args.out, args.markdown, args.budget, args.timeouts))


if __name__ == "__main__":
    main()
