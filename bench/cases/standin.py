"""standin (issue 38): the device path measured without a device. `kiln run` (and a warm `kiln
worker`) over 640×480 JPEGs with `KILN_DEVICE_STANDIN=h200`: chunks, prep checking headers,
the Batcher and the staged device pipeline run as on a GPU host, with the device's decode and
forward replaced by waits calibrated on the H200 (`workers/device/standin.py`).

Kiln's defaults throughout, the content cache on (where every other case turns it off): that
is what a user runs. Each run has a fresh data dir, so the cache holds nothing; the worker's
jobs take disjoint images, so none is found there either.

Each subject runs over N/2 and N images (the worker: two jobs). Its rate is the larger run's
steady window: from the first batch done to the last, read from the stand-in's timeline (a
`kiln run` of a few thousand rows lasts a second or two, start-up several: a marginal rate,
(N − N/2) / (t_N − t_N/2), is mostly start-up noise on a shared machine; it is kept beside).
Every CPU figure is marginal, as `feed`'s, so start-up and model load cancel. Per row: the
engine-owning process's CPU in µs, in total and per thread group (from the stand-in's report
of every thread's CPU clock); the prep processes' CPU. The stand-in device's busy share: its
forward seconds over the window's. Per batch, of the
larger run: each single-threaded stage's GIL release points (torch calls + hand-overs,
counted on sampled batches), the mean batch, the pipeline's verdict; and the engine
process's peak thread count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil

from bench.cases import bigjob, embedded, feed
from bench.context import Context
from bench.inputs import link_folder, make_images
from bench.models import BUILTIN_MODELS, detector_model, export_resnet, labels
from bench.results import CaseResult, Sized, marginal
from bench.stack import Layout, Registered, Stack, local_deployment
from devstack.services import kiln_command, service_env

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
        return _result(subject, model_name, small, large, window(large[1], 0, count))
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
    wall seconds, CPU (`engine`: the main process, which owns the engine; `children`: the
    prep processes) and the stand-in's report."""
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
    with (ctx.log_dir / f"standin-{model.name}-{items}.log").open("wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        own = feed._exited_own_cpu(proc.pid)
        _pid, status, rusage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    if (code := os.waitstatus_to_exitcode(status)) != 0:
        raise RuntimeError(f"kiln run failed (exit {code}); see {log.name}")
    embedded.check_output(output, items)
    total = rusage.ru_utime + rusage.ru_stime
    cpu = {"engine": round(own, 3), "prep": round(total - own, 3)}
    return Sized(items, round(seconds, 3), cpu), json.loads(report.read_text())


# ---- kiln worker -------------------------------------------------------------------------


def _worker(ctx: Context, model: Registered, images: list[Path], count: int) -> CaseResult:
    """A Kiln on local storage whose one worker runs the stand-in; a warm-up job, then two
    bulk jobs of N/2 and N images none of the others had (the content cache is on), their
    difference the marginal as for `kiln run`."""
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
    before = small[2].get("rows", {}).get("forward", 0)
    steady = window(large[2], before, count)
    return _result("standin-worker", model.name, small[:2], large[:2], steady)


def _snapshot(pid: int, report: Path) -> dict[str, Any]:
    """The worker's stand-in report and its prep processes' CPU, once the report is current."""
    time.sleep(REPORT_S)
    children = psutil.Process(pid).children(recursive=True)
    prep = sum(sum(c.cpu_times()[:2]) for c in children if c.is_running())
    found: dict[str, Any] = json.loads(report.read_text())
    found["prep_cpu_s"] = prep
    return found


def _timed_job(
    stack: Stack, ref: str, sources: list[str], pid: int, report: Path, before: dict[str, Any]
) -> tuple[Sized, dict[str, Any], dict[str, Any]]:
    """One job: its rows, wall seconds, CPU (engine, prep) and its part of the report."""
    job = feed._job(stack, ref, sources)
    after = _snapshot(pid, report)
    delta = _delta(before, after)
    cpu = {"engine": delta["process_cpu_s"], "prep": round(delta["prep_cpu_s"], 3)}
    return Sized(job.items, job.seconds, cpu), delta, after


# ---- the figures -------------------------------------------------------------------------


def window(report: dict[str, Any], before: int, rows: int) -> dict[str, float] | None:
    """The steady part of a run from the stand-in's timeline (a tick every 0.1 s): from the
    first tick after its first batch to the first that has all `rows` (after `before`):
    rows, seconds, the device's busy share and the process's CPU per row in it. None when
    the run was too short for two such ticks."""
    ticks = report.get("timeline", [])
    start = next((t for t in ticks if t[1] > before), None)
    end = next((t for t in ticks if t[1] >= before + rows), None)
    if start is None or end is None or end[0] <= start[0] or end[1] <= start[1]:
        return None
    done, seconds = end[1] - start[1], end[0] - start[0]
    return {
        "rows": done,
        "seconds": round(seconds, 3),
        "rows_per_s": round(done / seconds, 1),
        "device_busy_share": round((end[2] - start[2]) / seconds, 3),
        "engine_cpu_us_per_row": round(1e6 * (end[3] - start[3]) / done, 1),
    }


def _result(
    case: str,
    model: str,
    small: tuple[Sized, dict[str, Any]],
    large: tuple[Sized, dict[str, Any]],
    steady: dict[str, float] | None,
) -> CaseResult:
    """The row: its rate the steady window's (the marginal's where the run was too short for
    one), every CPU figure marginal (its CPU seconds: the marginal per row × the rows)."""
    result = marginal(case, model, small[0], large[0], extra={"standin": STANDIN})
    rows, seconds = result.items, result.seconds
    groups = _by_group(large[1], rows, small[1])
    engine_us = 1e6 * result.cpu_seconds["engine"] / rows if rows else 0.0
    probe = groups.get("stand-in probe", 0.0)
    groups["other"] = round(engine_us - sum(groups.values()), 1)
    forward = _get(large[1], "busy_s", "forward") - _get(small[1], "busy_s", "forward")
    prep_us = 1e6 * result.cpu_seconds["prep"] / rows if rows else 0.0
    result.extra.update(
        marginal_rows_per_s=round(rows / seconds, 1) if seconds > 0 else None,
        steady=steady,
        # Kiln's, without the stand-in's own sampler (shown apart among the groups)
        engine_cpu_us_per_row=round(engine_us - probe, 1),
        engine_cpu_us_per_row_by_group=groups,
        prep_cpu_us_per_row=round(prep_us, 1),
        device_busy_share=steady["device_busy_share"] if steady else _share(forward, seconds),
        batch_sizes=large[1].get("batch_sizes"),
        mean_batch=_mean_batch(large[1]),
        gil_release_points_per_batch=_release_points(large[1]),
        peak_threads=large[1].get("peak_threads"),
        verdicts=[p["verdict"] for p in large[1].get("pipelines", [])],
        rate_is="the steady window" if steady else "marginal over two sizes",
    )
    if steady:
        result.items, result.seconds = int(steady["rows"]), steady["seconds"]
        result.cpu_seconds = {
            "engine": round((engine_us - probe) * steady["rows"] / 1e6, 3),
            "prep": round(prep_us * steady["rows"] / 1e6, 3),
        }
    return result


def _share(busy: float, seconds: float) -> float | None:
    return round(busy / seconds, 3) if seconds > 0 else None  # None: not measurable


def _get(report: dict[str, Any], key: str, kind: str) -> float:
    return float(report.get(key, {}).get(kind, 0.0))


def _group(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def _cpu_by_group(report: dict[str, Any]) -> dict[str, float]:
    found: dict[str, float] = {}
    for thread in report.get("threads", []):
        group = _group(thread["name"])
        if group != "other":
            found[group] = found.get(group, 0.0) + thread["cpu_s"]
    return found


def _by_group(large: dict[str, Any], rows: int, small: dict[str, Any]) -> dict[str, float]:
    """Marginal CPU µs per row of each thread group ("other" is left to the caller)."""
    after, before = _cpu_by_group(large), _cpu_by_group(small)
    return {
        group: round(1e6 * (after.get(group, 0.0) - before.get(group, 0.0)) / max(rows, 1), 1)
        for group, _pattern in GROUPS
        if group in after
    }


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


def _sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0) - b.get(k, 0) for k in {*a, *b}}
