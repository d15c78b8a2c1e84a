"""feed (issue 23): how well Kiln feeds an accelerator — a model that costs nothing (as a GPU
engine looks beside the CPU work) over 640×480 JPEGs, Kiln against a DataLoader peer on the
same files.

Every subject runs twice, over the first half of the images and over all of them, and is
reported at its marginal rate, (n_large − n_small) / (t_large − t_small), so start-up and model
load cancel; CPU likewise. Subjects: `kiln run` (and again with one prep process), a warm
`kiln worker` on local storage fed a job written straight into Postgres, and the peer
(bench/cases/feed_peer.py); beside them, the CPU of Kiln's own decode + fit alone, per image.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg

from bench.cases import bigjob, embedded
from bench.cases.services import meter
from bench.child import run_child
from bench.context import Context
from bench.inputs import link_folder, make_images
from bench.measure import Meter
from bench.models import labels, null_model
from bench.results import FEED_MODEL, CaseResult, Sized, marginal
from bench.stack import CLOSED, Layout, Registered, Stack, local_deployment
from devstack.services import kiln_command, service_env

SIZE = (640, 480)
SIDE = 224  # the null model's input: a centre crop of the short side resized to 256
SUBJECTS = ("feed-embedded", "feed-embedded-1prep", "feed-worker", "feed-peer", "feed-decode-fit")
ONE_PREP = {"KILN_PREP_PROCESSES": "1"}  # issue 23's setting; ignored by a Kiln without it
WARM_UP = 32  # items of the worker's first job: the model is loaded before anything is timed
DECODE_FIT_FILES = 400  # at most: enough for a steady ms/image, a few seconds on one core
POLL_S = 0.02  # between two reads of the job row's status


def run(ctx: Context, subject: str) -> CaseResult:
    folder = ctx.workdir / "images" / f"{SIZE[0]}x{SIZE[1]}-feed"  # grows, never regenerated
    images = make_images(folder, ctx.plan.feed_images, SIZE)
    model = _model(ctx.workdir)
    if subject == "feed-embedded":
        return _embedded(ctx, model, images, subject, {})
    if subject == "feed-embedded-1prep":
        return _embedded(ctx, model, images, subject, ONE_PREP)
    if subject == "feed-worker":
        return _worker(ctx, model, images)
    args = {"model": FEED_MODEL, "onnx": str(model.onnx), "size": SIDE}
    if subject == "feed-peer":
        files = {"small": _strs(images[: _small(images)]), "large": _strs(images)}
        return run_child("feed_peer", {**args, "what": "peer", **files}, ctx.log_dir)
    if subject == "feed-decode-fit":
        files = {"files": _strs(images[:DECODE_FIT_FILES])}
        return run_child("feed_peer", {**args, "what": "decode-fit", **files}, ctx.log_dir)
    raise ValueError(f"unknown feed subject {subject!r}")


def _small(images: list[Path]) -> int:
    return len(images) // 2


def _strs(paths: list[Path]) -> list[str]:
    return [str(p) for p in paths]


def _model(workdir: Path) -> Registered:
    path = null_model(workdir / "models" / f"null-{SIDE}.onnx", SIDE)
    return Registered(FEED_MODEL, path, SIDE, labels(3))


def _folder(ctx: Context, images: list[Path]) -> Path:
    """A folder of links to `images`, for `kiln run` (which reads every image in a folder)."""
    return link_folder(ctx.workdir / "feed" / f"links-{len(images)}", images)


# ---- kiln run ----------------------------------------------------------------------------


def _embedded(
    ctx: Context, model: Registered, images: list[Path], case: str, settings: dict[str, str]
) -> CaseResult:
    small = _kiln_run(ctx, model, _folder(ctx, images[: _small(images)]), case, settings)
    large = _kiln_run(ctx, model, _folder(ctx, images), case, settings)
    return marginal(case, FEED_MODEL, small, large, extra={"settings": settings})


def _kiln_run(
    ctx: Context, model: Registered, folder: Path, case: str, settings: dict[str, str]
) -> Sized:
    """One `kiln run` over `folder` into a fresh data dir, the model registered first (not
    timed): wall seconds and CPU of the whole tree (`subject`), of the main process alone
    (`engine`: the one that owns the engine) and of its children (`children`, the rest)."""
    items = len(list(folder.iterdir()))
    data = ctx.workdir / "feed" / f"{case}-{items}"
    shutil.rmtree(data, ignore_errors=True)
    env = service_env({**dict(ctx.plan.kiln_env), "KILN_DATA_DIR": str(data), **settings})
    embedded.add_model(env, model, ctx.workdir)
    output = data / "results.parquet"
    command = kiln_command("run", str(folder), "--model", model.name, "-o", str(output))
    with (ctx.log_dir / f"{case}-{items}.log").open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        with Meter({"subject": [proc.pid]}).window() as usage:
            own = _exited_own_cpu(proc.pid)
            # wait4: the CPU of the process and its reaped children, read as it is reaped.
            _pid, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise RuntimeError(f"kiln run failed (exit {code}); see {log.name}")
    embedded.check_output(output, items)
    total = rusage.ru_utime + rusage.ru_stime
    cpu = {"subject": total, "engine": own, "children": total - own}
    return Sized(items, round(usage.seconds, 3), {k: round(v, 3) for k, v in cpu.items()})


@dataclass(frozen=True)
class Exited:
    """A command run to its end: wall seconds, its own CPU, and its own with its reaped
    children's."""

    seconds: float
    own_cpu: float
    total_cpu: float


def run_to_exit(command: list[str], env: dict[str, str], log_path: Path) -> Exited:
    """Run `command` (a `kiln run`) to its end, its output into `log_path`; a non-zero exit
    raises."""
    with log_path.open("wb") as log:
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        own = _exited_own_cpu(proc.pid)
        _pid, status, rusage = os.wait4(proc.pid, 0)  # the children's CPU, read as it is reaped
        seconds = time.perf_counter() - started
    if (code := os.waitstatus_to_exitcode(status)) != 0:
        raise RuntimeError(f"kiln run failed (exit {code}); see {log_path}")
    return Exited(seconds, own, rusage.ru_utime + rusage.ru_stime)


def _exited_own_cpu(pid: int) -> float:
    """The CPU seconds of process `pid` alone (its threads, not its children), read once it
    has exited: waitid(WNOWAIT) leaves it a zombie whose /proc/PID/stat still holds its final
    times, so nothing after a last sample is lost, as a polling thread would lose it."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


# ---- kiln worker -------------------------------------------------------------------------


def _worker(ctx: Context, model: Registered, images: list[Path]) -> CaseResult:
    """A Kiln on local storage with one worker; the images put once into its store. Each size
    is one bulk job written into Postgres (as bigjob does), all its chunks sent through Kiln's
    dispatcher, timed until the job row says completed."""
    layout = Layout(name="feed", storage="local")
    parent = ctx.require_stack()
    with local_deployment(parent, ctx.log_dir, dict(ctx.plan.kiln_env), layout) as stack:
        stack.register(model, ctx.workdir)
        sources = bigjob.put_inputs(stack, images, prefix="bench/feed")
        ref = bigjob.model_ref(stack, model.name)
        _job(stack, ref, sources[:WARM_UP])  # the worker loads the model
        small = _job(stack, ref, sources[: _small(images)])
        large = _job(stack, ref, sources)
    return marginal("feed-worker", FEED_MODEL, small, large)


def _job(stack: Stack, ref: str, sources: list[str]) -> Sized:
    """One bulk-sized job of `sources` (queue `bulk`, chunks of bulk_chunk_size), from the send
    of its chunks until the job row is completed; CPU of the worker tree (`subject`), Postgres
    and Redis (`services`) and this driver."""
    dsn, size = bigjob.database_dsn(stack.settings.database_url), stack.settings.bulk_chunk_size
    job_id = bigjob.create_big_job(
        dsn,
        tenant=bigjob.TENANT,
        model_ref=ref,
        total=len(sources),
        chunk_size=size,
        inputs=sources,
    )
    chunks = bigjob.chunk_item_ids(dsn, job_id, math.ceil(len(sources) / size))
    workers = meter(stack, [w.pid for w in stack.workers])
    with psycopg.connect(dsn, autocommit=True) as conn, workers.window() as usage:
        bigjob.send_chunks(stack, job_id, chunks)
        status = _closed(conn, job_id)
    _ms, job = bigjob.get_job(stack.http, job_id)
    if status != "completed" or job["counts"]["succeeded"] != len(sources):
        raise RuntimeError(f"feed-worker: job ended {status} with {job['counts']}")
    return Sized(len(sources), round(usage.seconds, 3), usage.cpu_seconds)


def _closed(conn: psycopg.Connection[Any], job_id: str, timeout: float = 1800) -> str:
    """The job row's status once it is closed (completed, failed, cancelled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute("SELECT status FROM jobs WHERE id = %s", (job_id,)).fetchone()
        if row is not None and row[0] in CLOSED:
            return str(row[0])
        time.sleep(POLL_S)
    raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s")
