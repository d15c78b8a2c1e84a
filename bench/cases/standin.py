"""standin (issue 38): the device path measured without a device. `kiln run` (and a warm `kiln
worker`) over 640×480 JPEGs with `KILN_DEVICE_STANDIN=h200`: chunks, prep checking headers,
the Batcher and the device stages run as on a GPU host, with the device's decode and
forward replaced by waits calibrated on the H200 (`workers/engines/standin.py`).

Kiln's defaults throughout, the content cache on (where every other case turns it off): that
is what a user runs. Each run has a fresh data dir, so the cache holds nothing; the worker's
jobs take disjoint images, so none is found there either. The worker's deployment departs
only in what caps a tenant's jobs (bench/stack.py's LIMITS), nothing on the engine's path.

Each subject runs over N/2 and N images (the worker: two jobs). A `kiln run`'s figures are
its larger run's steady window, from the stand-in's first tick after a batch ran to its last
(ticks every 0.1 s): a run of a few thousand rows lasts a second or two and its start-up
several, so a marginal, (N − N/2) / (t_N − t_N/2), is mostly start-up noise on a shared
machine (it is kept beside). But prep's CPU is the marginal's (wait4: exact, and start-up
cancels): the prep processes run ahead of the engine, some of a window's rows prepped before
it opened. The worker's are its N-image job's steady window (the stand-in opens a new one
when batches resume after a pause), prep's the whole job's per row; the job whole (from its
chunks sent to its row completed) and the marginal of the two jobs are kept beside.

Per row: the engine-owning process's CPU in µs, in total and per thread group (each
thread's CPU clock, from the stand-in's report); the prep processes' CPU; the rate and the
stand-in device's busy share (its forward seconds over the wall seconds). Per batch, of the
larger run: each stage thread's GIL release points (torch calls + hand-overs, counted on
sampled batches), the batch sizes, the device stages' verdict; the engine process's peak thread
count.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cases import bigjob, embedded, feed
from bench.context import Context
from bench.inputs import link_folder, make_images
from bench.models import BUILTIN_MODELS, detector_model, export_resnet, labels
from bench.results import CaseResult, Sized, marginal
from bench.stack import Layout, Registered, Stack, local_deployment
from devstack.services import kiln_command, service_env
from kiln.workers.engines.standin import children_cpu

SUBJECTS = ("standin-run", "standin-worker")
STANDIN = "h200"
WARM_UP = 32  # the worker's first job's images: the model is loaded before anything is timed
REPORT_S = 1.3  # the stand-in writes its report every second: a read after this is current
RESNET_INPUT = 224

# Thread groups of the engine-owning process, by the thread's name (first match wins).
GROUPS = (
    ("chunk threads", re.compile(r"^ThreadPoolExecutor-")),  # Celery's thread pool
    ("batcher runners", re.compile(r"-runner-\d+$")),
    ("prep collector", re.compile(r"^kiln-prep-collector$")),
    ("prep senders", re.compile(r"^kiln-prep-send-")),
    ("stage decode", re.compile(r"-device-decode-\d+$")),
    ("stage fit", re.compile(r"-device-fit-\d+$")),
    ("stage forward", re.compile(r"-(device|host)-forward-\d+$")),
    ("stage outputs", re.compile(r"-(device|host)-outputs-\d+$")),
    ("stage upload", re.compile(r"-host-upload-\d+$")),
    ("lease keeper", re.compile(r"^kiln-leases$")),
    ("main", re.compile(r"^MainThread$")),
    ("stand-in probe", re.compile(r"^kiln-standin-probe$")),  # the measuring, not Kiln's
)


def run(ctx: Context, subject: str, model_name: str) -> CaseResult:
    folder = ctx.workdir / "images" / f"{feed.SIZE[0]}x{feed.SIZE[1]}-feed"  # feed's inputs
    count = ctx.plan.standin_images
    model = _model(ctx.workdir, model_name)
    if subject == "standin-run":
        images = make_images(folder, count, feed.SIZE)
        small = _kiln_run(ctx, model, images[: count // 2])
        large = _kiln_run(ctx, model, images)
        return _result(subject, model_name, small, large, window_span(large[1]))
    if subject == "standin-worker":
        images = make_images(folder, WARM_UP + count // 2 + count, feed.SIZE)
        return _worker(ctx, model, images, count)
    raise ValueError(f"unknown standin subject {subject!r}")


def _model(workdir: Path, name: str) -> Registered:
    if name in BUILTIN_MODELS:
        path, side, names = detector_model()
        return Registered(name, path, side, names)
    path = export_resnet(int(name.removeprefix("resnet")), workdir / "models" / f"{name}.onnx")
    return Registered(name, path, RESNET_INPUT, labels(1000))


def _settings(report: Path) -> dict[str, str]:
    return {"KILN_DEVICE_STANDIN": STANDIN, "KILN_DEVICE_STANDIN_REPORT": str(report)}


# ---- kiln run ----------------------------------------------------------------------------


def _kiln_run(ctx: Context, model: Registered, images: list[Path]) -> tuple[Sized, dict[str, Any]]:
    """One `kiln run` into a fresh data dir with Kiln's defaults (the stand-in aside): its
    wall seconds, CPU (`engine`: the main process, which owns the engine; `prep`: its
    children, the prep processes) and the stand-in's report."""
    items = len(images)
    folder = link_folder(ctx.workdir / "standin" / f"links-{items}", images)
    data = ctx.workdir / "standin" / f"run-{model.name}-{items}"
    shutil.rmtree(data, ignore_errors=True)
    report = data.parent / f"report-{model.name}-{items}.json"
    report.unlink(missing_ok=True)
    env = service_env({"KILN_DATA_DIR": str(data), **_settings(report)})
    if model.name not in BUILTIN_MODELS:
        embedded.add_model(env, model, ctx.workdir)
    output = data / "results.parquet"
    command = kiln_command("run", str(folder), "--model", model.name, "-o", str(output))
    ran = feed.run_to_exit(command, env, ctx.log_dir / f"standin-{model.name}-{items}.log")
    embedded.check_output(output, items)
    cpu = {"engine": round(ran.own_cpu, 3), "prep": round(ran.total_cpu - ran.own_cpu, 3)}
    return Sized(items, round(ran.seconds, 3), cpu), json.loads(report.read_text())


# ---- kiln worker -------------------------------------------------------------------------


def _worker(ctx: Context, model: Registered, images: list[Path], count: int) -> CaseResult:
    """A Kiln on local storage whose one worker runs the stand-in; a warm-up job, then two
    bulk jobs of N/2 and N images none of the others had (the content cache is on). The
    figures are the N-image job's (`_job_window`); the marginal of the two is kept beside."""
    report = ctx.log_dir / f"standin-worker-{model.name}.json"
    report.unlink(missing_ok=True)
    layout = Layout(name="standin", storage="local")
    parent = ctx.require_stack()
    with local_deployment(parent, ctx.log_dir, _settings(report), layout) as stack:
        if model.name not in BUILTIN_MODELS:
            stack.register(model, ctx.workdir)
        sources = bigjob.put_inputs(stack, images, prefix="bench/standin")
        ref = bigjob.model_ref(stack, model.name)
        [worker] = stack.workers
        feed._job(stack, ref, sources[:WARM_UP])
        rest = sources[WARM_UP:]
        first = _snapshot(worker.pid, report)
        small = _timed_job(stack, ref, rest[: count // 2], worker.pid, report, first)
        large = _timed_job(stack, ref, rest[count // 2 :], worker.pid, report, small[2])
    return _result("standin-worker", model.name, small[:2], large[:2], _job_window(small, large))


def _snapshot(pid: int, report: Path) -> dict[str, Any]:
    """The worker's stand-in report and its prep processes' CPU, once the report is current."""
    time.sleep(REPORT_S)
    found: dict[str, Any] = json.loads(report.read_text())
    found["prep_cpu_s"] = children_cpu(pid)
    return found


def _timed_job(
    stack: Stack, ref: str, sources: list[str], pid: int, report: Path, before: dict[str, Any]
) -> tuple[Sized, dict[str, Any], dict[str, Any]]:
    """One job: its rows, wall seconds, CPU (engine, prep) and its part of the report."""
    job = feed._job(stack, ref, sources)
    after = _snapshot(pid, report)
    delta = {**_delta(before, after), "job_seconds": job.seconds}
    cpu = {"engine": delta["process_cpu_s"], "prep": round(delta["prep_cpu_s"], 3)}
    return Sized(job.items, job.seconds, cpu), delta, after


# ---- the figures -------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """What the engine-owning process did over a stretch of a run: rows, wall seconds, its
    CPU and its prep processes', the stand-in device's forward seconds, and its CPU by
    thread group."""

    rows: int
    seconds: float
    engine_cpu_s: float
    prep_cpu_s: float
    forward_s: float
    groups: dict[str, float]
    how: str


def window_span(report: dict[str, Any]) -> Span | None:
    """A `kiln run`'s steady window, between the stand-in's first tick after a batch ran and
    its last that saw one (ticks every 0.1 s): start-up and the close are outside it. None
    when the run was too short for two such ticks."""
    edges = report.get("window", {})
    first, last = edges.get("first"), edges.get("last")
    if first is None or last is None:
        return None
    (t0, rows0, forward0, cpu0), (t1, rows1, forward1, cpu1) = first["tick"], last["tick"]
    if t1 <= t0 or rows1 <= rows0:
        return None
    groups = _sub(_cpu_by_group(last), _cpu_by_group(first))
    prep = last["prep_cpu_s"] - first["prep_cpu_s"]
    return Span(rows1 - rows0, t1 - t0, cpu1 - cpu0, prep, forward1 - forward0, groups,
                "the steady window (first batch to last)")  # fmt: skip


def job_span(delta: dict[str, Any]) -> Span:
    """A worker job's figures (`_delta`: what the job added to the stand-in's report)."""
    rows = int(delta["rows"].get("forward", 0))
    seconds = delta["job_seconds"]
    return Span(rows, seconds, delta["process_cpu_s"], delta["prep_cpu_s"],
                delta["busy_s"].get("forward", 0.0), _cpu_by_group(delta),
                "the larger job, from its chunks sent to its row completed")  # fmt: skip


def _job_window(
    small: tuple[Sized, dict[str, Any], dict[str, Any]],
    large: tuple[Sized, dict[str, Any], dict[str, Any]],
) -> Span:
    """The worker's N-image job: its steady window (the stand-in opens one when batches
    resume after a pause) with prep's CPU from the whole job; the job whole where the window
    is not the job's."""
    job = job_span(large[1])
    before = small[2].get("rows", {}).get("forward", 0)
    steady = window_span(large[2])
    first = large[2].get("window", {}).get("first", {}).get("tick", [0, 0])
    if steady is None or first[1] <= before:
        return job
    prep = job.prep_cpu_s * steady.rows / job.rows if job.rows else 0.0
    return Span(steady.rows, steady.seconds, steady.engine_cpu_s, prep, steady.forward_s,
                steady.groups, f"{steady.how}; prep's: the whole job's per row")  # fmt: skip


def marginal_span(small: tuple[Sized, dict[str, Any]], large: tuple[Sized, dict[str, Any]]) -> Span:
    """The larger run less the smaller: start-up and model load cancel."""
    (a, a_report), (b, b_report) = small, large
    forward = _get(b_report, "busy_s", "forward") - _get(a_report, "busy_s", "forward")
    groups = _sub(_cpu_by_group(b_report), _cpu_by_group(a_report))
    return Span(b.items - a.items, b.seconds - a.seconds,
                b.cpu_seconds["engine"] - a.cpu_seconds["engine"],
                b.cpu_seconds["prep"] - a.cpu_seconds["prep"], forward, groups,
                "marginal over two sizes")  # fmt: skip


def figures(span: Span) -> dict[str, Any]:
    """Per row: the engine process's CPU µs (Kiln's: the stand-in's own sampler apart) and
    by thread group ("other": what no group holds), prep's; the rate and device busy share."""
    per_row = 1e6 / span.rows if span.rows > 0 else 0.0
    groups = {g: round(v * per_row, 1) for g, v in span.groups.items()}
    probe = groups.get("stand-in probe", 0.0)
    engine = span.engine_cpu_s * per_row
    groups["other"] = round(engine - sum(groups.values()), 1)
    return {
        "rows_per_s": round(span.rows / span.seconds, 1) if span.seconds > 0 else None,
        "device_busy_share": _share(span.forward_s, span.seconds),
        "engine_cpu_us_per_row": round(engine - probe, 1),
        "engine_cpu_us_per_row_by_group": groups,
        "prep_cpu_us_per_row": round(span.prep_cpu_s * per_row, 1),
        "rows": span.rows,
        "seconds": round(span.seconds, 3),
        "figures_are": span.how,
    }


def _result(
    case: str,
    model: str,
    small: tuple[Sized, dict[str, Any]],
    large: tuple[Sized, dict[str, Any]],
    span: Span | None,
) -> CaseResult:
    """The row: the span's figures (the marginal's where the run was too short for a
    window), the marginal's beside; per batch, the larger run's counts and verdict."""
    result = marginal(case, model, small[0], large[0], extra={"standin": STANDIN})
    beside = figures(marginal_span(small, large))
    main = figures(span) if span is not None else beside
    if case == "standin-worker":
        whole = figures(job_span(large[1]))
        main["job"] = {k: whole[k] for k in ("rows_per_s", "rows", "seconds", "figures_are")}
    if case == "standin-run" and span is not None:  # prep runs ahead of a window (module doc)
        main["prep_cpu_us_per_row_in_window"] = main["prep_cpu_us_per_row"]
        main["prep_cpu_us_per_row"] = beside["prep_cpu_us_per_row"]
    report = large[1]
    result.extra.update(
        **main,
        marginal=beside,
        batch_sizes=report.get("batch_sizes"),
        mean_batch=_mean_batch(report),
        gil_release_points_per_batch=_release_points(report),
        peak_threads=report.get("peak_threads"),
        verdicts=[p["verdict"] for p in report.get("pipelines", [])],
    )
    if span is not None and span.rows > 0 and span.seconds > 0:
        result.items, result.seconds = span.rows, round(span.seconds, 3)
        prep_s = main["prep_cpu_us_per_row"] * span.rows / 1e6
        result.cpu_seconds = {"engine": round(span.engine_cpu_s, 3), "prep": round(prep_s, 3)}
    return result


def _share(busy: float, seconds: float) -> float | None:
    return round(busy / seconds, 3) if seconds > 0 else None  # None: not measurable


def _get(report: dict[str, Any], key: str, kind: str) -> float:
    return float(report.get(key, {}).get(kind, 0.0))


def group_of(
    name: str, groups: tuple[tuple[str, re.Pattern[str]], ...] = GROUPS, other: str = "other"
) -> str:
    """A thread's group by its name: the first of `groups` whose pattern it matches."""
    return next((group for group, pattern in groups if pattern.search(name)), other)


def _cpu_by_group(report: dict[str, Any]) -> dict[str, float]:
    """CPU seconds of the named groups' threads ("other": what the process total leaves)."""
    found: dict[str, float] = {}
    for thread in report.get("threads", []):
        group = group_of(thread["name"])
        if group != "other":
            found[group] = found.get(group, 0.0) + thread["cpu_s"]
    return found


def _mean_batch(report: dict[str, Any]) -> float | None:
    batches = report.get("batches", {}).get("forward")
    return round(report["rows"]["forward"] / batches, 1) if batches else None


def _release_points(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per stage thread: torch calls and hand-overs per sampled batch, and their sum."""
    found = {}
    for stage in report.get("stages", []):
        sampled = stage["sampled"]
        if not sampled:
            continue
        calls, handed = stage["calls"] / sampled, stage["handed"] / sampled
        found[stage["thread"]] = {
            "torch_calls": round(calls, 1), "hand_overs": round(handed, 1),
            "total": round(calls + handed, 1), "sampled_batches": sampled,
        }  # fmt: skip
    return found


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`after` less `before`: what one worker job added to the report (verdicts: after's)."""
    cpu_before = {(t["tid"], t["name"]): t["cpu_s"] for t in before.get("threads", [])}
    threads = [
        {**t, "cpu_s": t["cpu_s"] - cpu_before.get((t["tid"], t["name"]), 0.0)}
        for t in after.get("threads", [])
    ]
    stages_before = {s["thread"]: s for s in before.get("stages", [])}
    stages = [
        {**s, **{k: s[k] - stages_before.get(s["thread"], {}).get(k, 0) for k in _COUNTS}}
        for s in after.get("stages", [])
    ]  # fmt: skip
    return {
        **after,
        "threads": threads,
        "stages": stages,
        "process_cpu_s": round(after["process_cpu_s"] - before["process_cpu_s"], 3),
        "prep_cpu_s": after["prep_cpu_s"] - before["prep_cpu_s"],
        **{key: _sub(after.get(key, {}), before.get(key, {})) for key in _TOTALS},
    }


_COUNTS = ("batches", "sampled", "calls", "handed")
_TOTALS = ("busy_s", "batches", "rows")


def _sub(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in {*a, *b}}
