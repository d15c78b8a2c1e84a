"""`bench.gpu`'s parts, each run in a child process of its own by the driver (`bench.gpu`):
`prepare` (the JPEGs and the ONNX file), then a to f as that module's docstring says (f, the
service path, in bench/gpu_service.py). What
crosses: the run's `Settings` in, and a part's rows and facts out through its `Sink` (a JSON
file rewritten after each row, so a killed part keeps what it measured)."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_feed import (
    SIDE,
    Busy,
    Subject,
    device_stages_verdicts,
    images,
    kiln_run,
    kiln_subject,
    peer_subject,
)
from bench.gpu_report import Row, marginal_busy, row, skipped, write_atomic
from kiln.workers.engines.cuda_graphs import buckets

if TYPE_CHECKING:
    from bench.gpu_service import Service
    from kiln.workers.engines.torch_engine import TorchEngine

NATIVE_BATCHES = (16, 64, 256)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Settings:
    """What one run was asked for (the command line's options), passed to every part."""

    workdir: Path
    device: str
    images: int
    seconds: float
    max_batch: int
    engine: str  # KILN_ENGINE of the `kiln run`s
    skip: frozenset[str]


def native_batches(max_batch: int) -> list[int]:
    return sorted({min(b, max_batch) for b in NATIVE_BATCHES})


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
        write_atomic(self.path, json.dumps({"rows": self.rows, "facts": self.facts}, indent=1))


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


def build_engine(s: Settings, graphs: bool, runners: int = 1) -> tuple[TorchEngine, float]:
    """Kiln's torch engine over the ONNX ResNet-50 (taking uint8 NHWC pixels, normalising them
    itself), and the seconds its build took."""
    from kiln.workers.engines.base import EngineRequest
    from kiln.workers.engines.torch_engine import build_torch_engine, require_torch
    from kiln.workers.engines.uint8_input import Normalization

    normalization = Normalization(mean=MEAN, std=STD)
    request = EngineRequest(
        "resnet50", onnx_path(s.workdir), s.max_batch, normalization=normalization
    )
    require_torch()  # imported before the clock starts: the build is the convert, not imports
    started = time.perf_counter()
    engine = build_torch_engine(request, s.device, runners=runners, precision="auto", graphs=graphs)
    return engine, round(time.perf_counter() - started, 2)


def engine_call(engine: TorchEngine, batch: int) -> Callable[[], object]:
    """One `infer` over a host uint8 NHWC batch of random pixels."""
    import numpy as np

    spec = engine.inputs[0]
    pixels = np.random.default_rng(batch).integers(0, 256, (batch, SIDE, SIDE, 3), np.uint8)
    return partial(engine.infer, {spec.name: pixels})


def _engine_rows(s: Settings, sink: Sink, graphs: bool, batches: Iterable[int]) -> None:
    engine, build_s = build_engine(s, graphs)
    sink.fact(f"build_s graphs={graphs}", build_s)
    # Whether graphs=True took (a dynamic shape runs eagerly), and the engine's own account.
    sink.fact(f"replays graphs graphs={graphs}", engine.graphs is not None)
    sink.fact(f"reason graphs={graphs}", engine.reason)
    subject = f"engine graphs={graphs}"
    for batch in batches:
        timing = timed(engine_call(engine, batch), s.seconds, _sync(s.device))
        sink.add({**_timed_row("engine", subject, batch, timing), "graphs": graphs})


WORKER_FED = "engine as a worker feeds it (2 runners, gathered into staging)"
STAGED_FED = "engine as a worker feeds it, staged (upload, forward, outputs overlapped)"


def _fed(
    engine: TorchEngine, feed: Callable[[Any], object], callers: int, batch: int, seconds: float
) -> tuple[float, list[float], float]:
    """`callers` threads, each gathering `batch` rows from an array of slots into its own
    staging buffer (`np.take`, as the worker's gather does) and handing it to `feed`, for
    `seconds`: images/s, NVML's samples, and the first (warming) call's seconds."""
    import threading

    import numpy as np

    slots = np.random.default_rng(0).integers(0, 256, (512, SIDE, SIDE, 3), np.uint8)
    counts = [0] * callers

    def run(i: int, until: float) -> None:
        picks = np.random.default_rng(i).choice(len(slots), batch, replace=False)
        while counts[i] == 0 or time.perf_counter() < until:
            buffer = engine.host_buffer((batch, SIDE, SIDE, 3))
            np.take(slots, picks, axis=0, out=buffer)
            feed(buffer)
            counts[i] += 1

    first = time.perf_counter()
    run(0, 0.0)  # warm: each thread's staging is made on its first call (and each stream)
    first = time.perf_counter() - first
    counts[0] = 0
    with Busy(interval=0.05) as busy:
        started = time.perf_counter()
        until = started + seconds
        threads = [threading.Thread(target=run, args=(i, until)) for i in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    return sum(counts) * batch / elapsed, busy.samples, round(first, 3)


def _worker_fed_rows(s: Settings, sink: Sink) -> None:
    """The engine as a worker drove it before issue 33: two runner threads, each gathering its
    batch into the engine's staging buffer and running it, so one thread's copies overlap the
    other's work on the GPU."""
    engine, _seconds = build_engine(s, True, runners=2)
    name = engine.inputs[0].name
    for batch in native_batches(s.max_batch):
        feed = partial(_infer, engine, name)
        rate, samples, first = _fed(engine, feed, 2, batch, s.seconds)
        sink.add({**row("engine", WORKER_FED, batch, rate, samples), "first_call_s": first})


def _infer(engine: TorchEngine, name: str, buffer: Any) -> object:
    return engine.infer({name: buffer})


def _staged_fed_rows(s: Settings, sink: Sink) -> None:
    """The engine as a worker with the device stages drives it (issue 33): as many caller
    threads as the device stages hold batches, each gathering into its own staging buffer and
    running it through upload → forward → outputs (`device.image_stages.HostStages`)."""
    from kiln.workers.device.image_stages import HostStages

    engine, _seconds = build_engine(s, True, runners=1)
    stages = HostStages("bench", engine, engine.inputs[0].name)
    callers = stages.device_stages.in_flight
    for batch in native_batches(s.max_batch):
        rate, samples, first = _fed(engine, stages.device_stages.run, callers, batch, s.seconds)
        sink.add({**row("engine", STAGED_FED, batch, rate, samples), "callers": callers,
                  "first_call_s": first, "stages": stages.device_stages.stats()})  # fmt: skip
    stages.close()


def part_engine(s: Settings, sink: Sink) -> None:
    """Every bucket the engine replays a graph for, the engine as a worker feeds it, and the
    same engine without CUDA graphs (the comparison) at the native batches."""
    replayed = partial(_engine_rows, s, sink, True, buckets(s.max_batch))
    attempt(sink, "engine", "engine graphs=True", replayed)
    _release(s.device)
    attempt(sink, "engine", WORKER_FED, lambda: _worker_fed_rows(s, sink))
    _release(s.device)
    attempt(sink, "engine", STAGED_FED, lambda: _staged_fed_rows(s, sink))
    _release(s.device)
    eager = partial(_engine_rows, s, sink, False, native_batches(s.max_batch))
    attempt(sink, "engine", "engine graphs=False", eager)


def _release(device: str) -> None:
    """The first engine's memory (its graphs' pools) back before the second is built."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# `kiln run`'s subjects: name → settings. The device stages (issue 33) are the default;
# `serial` is how every batch ran before it, measured beside it in the same session.
KILN_SUBJECTS = {
    "kiln run, GPU decode": {"KILN_GPU_DECODE": "true"},
    "kiln run, GPU decode, serial": {"KILN_GPU_DECODE": "true", "KILN_DEVICE_PIPELINE": "serial"},
    "kiln run, CPU decode": {"KILN_GPU_DECODE": "false"},
}


def part_kiln(s: Settings, sink: Sink) -> None:
    folders = image_folders(s.workdir)
    for name, extra in KILN_SUBJECTS.items():
        if s.device != "cuda" and extra["KILN_GPU_DECODE"] == "true":
            sink.add(skipped("kiln", name, "no GPU (its JPEG decoders need CUDA)"))
            continue
        run = partial(kiln_subject, name, s.workdir, onnx_path(s.workdir), folders, extra, s.engine)
        attempt(sink, "kiln", name, partial(_add_subject, sink, "kiln", run))


def _add_subject(sink: Sink, part: str, measure: Callable[[], Subject]) -> None:
    sink.add(_subject_row(part, measure()))


def _add_row(sink: Sink, measure: Callable[[], Row]) -> None:
    sink.add(measure())


def attempt(sink: Sink, part: str, subject: str, measure: Callable[[], None]) -> None:
    """One subject's measurement; its failure becomes its row (traceback in the part's log),
    and the part's other subjects still run."""
    try:
        measure()
    except Exception as error:
        traceback.print_exc()
        sink.add(skipped(part, subject, _sentence(error), "failed"))


def _sentence(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def service_subjects(device: str) -> list[tuple[str, str, str]]:
    """The service path's subjects: (row name, model, the `kiln run` row it is judged
    against). The worker decodes as Kiln does by default (nvJPEG where it is there), so on a GPU
    its ResNet-50 is set beside `kiln run` with GPU decode; the detector runs with defaults in
    both."""
    decode = "GPU" if device == "cuda" else "CPU"
    return [
        ("kiln worker, ResNet-50", "resnet50", f"kiln run, {decode} decode"),
        ("kiln worker, detector", "detector", "detector, kiln run"),
    ]


def part_service(s: Settings, sink: Sink) -> None:
    """`kiln api` + `kiln worker` on the named Postgres and Redis (bench/gpu_service.py), fed
    over HTTP; without them, rows that say why not."""
    from bench.gpu_service import service, why_not

    subjects = service_subjects(s.device)
    reason = why_not()
    if reason:
        for name, _model, _versus in subjects:
            sink.add(skipped("service", name, reason))
        return
    try:
        with service(s.workdir, s.device, s.engine, onnx_path(s.workdir), s.images) as svc:
            for key, value in svc.facts.items():
                sink.fact(key, value)
            for name, model, versus in subjects:
                measure = partial(_service_row, svc, name, model, versus, s.workdir)
                attempt(sink, "service", name, partial(_add_row, sink, measure))
    except Exception as error:  # the service did not start (or stop): the rows not yet written
        traceback.print_exc()
        done = {r["subject"] for r in sink.rows}
        for name, _model, _versus in subjects:
            if name not in done:
                sink.add(skipped("service", name, _sentence(error), "failed"))
    worker_log = s.workdir / "service-logs" / "worker.log"  # complete: the worker has stopped
    if worker_log.exists():
        for i, said in enumerate(device_stages_verdicts(worker_log)):
            sink.fact(f"worker device stages {i + 1}", said)


def _service_row(svc: Service, name: str, model: str, versus: str, work: Path) -> Row:
    from bench.gpu_service import measure

    m = measure(svc, name, model, image_folders(work))
    small, large = m.subject.small, m.subject.large
    wall = (large.seconds + m.submit_s["large"]) - (small.seconds + m.submit_s["small"])
    with_upload = (large.items - small.items) / wall if wall > 0 else 0.0
    return {**_subject_row("service", m.subject), "versus": versus, "submit_s": m.submit_s,
            "images_per_s_with_upload": round(with_upload, 1),
            "results": m.results}  # fmt: skip


def part_decoders(s: Settings, sink: Sink) -> None:
    """Each GPU JPEG decoder's rate at 1, 2 and 4 threads, and the CPU's (bench/gpu_decoders.py)."""
    from bench.gpu_decoders import measure

    paths = sorted(image_folders(s.workdir)[0].iterdir())
    for new in measure(paths, s.device, s.seconds):
        sink.add(new)


PROFILED = "kiln run under py-spy (GIL samples of the whole tree)"


def part_profile(s: Settings, sink: Sink) -> None:
    """One `kiln run` of the large folder (GPU decode on a GPU) under py-spy; the summary of
    where the Python time went is a fact of the part and `profile.log` (bench/gpu_profile.py)."""
    from bench.gpu_profile import command, parse, py_spy, summarise

    if py_spy() is None:
        sink.add(skipped("profile", PROFILED, "py-spy is not on PATH (the bundle's profile part)"))
        return
    raw = s.workdir / "profile.raw"
    extra = {"KILN_GPU_DECODE": "true" if s.device == "cuda" else "false"}
    run = kiln_run(s.workdir, onnx_path(s.workdir), image_folders(s.workdir)[1], extra, s.engine,
                   wrap=command(raw))  # fmt: skip
    summary = summarise(parse(raw.read_text().splitlines()))
    (s.workdir / "profile.log").write_text(summary + "\n")
    print(summary, flush=True)
    sink.fact("summary", summary)
    new = row("profile", PROFILED, None, run.items / run.seconds, run.sm_busy)
    sink.add({**new, "seconds": run.seconds, "cpu_s": run.cpu_s,
              "note": "whole run (start-up included), slowed by sampling"})  # fmt: skip


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
    new["pipelines"] = large.pipelines  # where the large run's time went, stage by stage
    if large.seconds <= small.seconds:  # tiny sizes: start-up noise outweighs the extra images
        new["note"] = "noise (large run not slower)"
    return new


def part_prepare(s: Settings, sink: Sink) -> None:
    """The JPEGs and their two folders (what c to f read), and the ONNX file (b, c and f)."""
    from bench.inputs import link_folder
    from bench.models import export_resnet

    if {"kiln", "peer", "detector", "service", "decoders", "profile"} - s.skip:
        paths = images(s.workdir / "images", s.images)
        small, large = image_folders(s.workdir)
        link_folder(small, paths[: len(paths) // 3])
        link_folder(large, paths)
        sink.fact("images", len(paths))
    if {"engine", "kiln", "service", "profile"} - s.skip:
        started = time.perf_counter()
        export_resnet(50, onnx_path(s.workdir))
        sink.fact("export_s", round(time.perf_counter() - started, 1))


def image_folders(work: Path) -> tuple[Path, Path]:
    return work / "small", work / "large"


def onnx_path(work: Path) -> Path:
    return work / "resnet50.onnx"


PART_FUNCTIONS: dict[str, Callable[[Settings, Sink], None]] = {
    "prepare": part_prepare, "native": part_native, "engine": part_engine,
    "kiln": part_kiln, "peer": part_peer, "detector": part_detector, "service": part_service,
    "decoders": part_decoders, "profile": part_profile,
}  # fmt: skip
