"""startup (issue 32): the start-up a user meets, apart from any throughput.

- `kiln run --help`: wall seconds of the whole command, the median of `startup_runs`;
- a prep process ready: from starting a pool of one to its first answer, in a fresh interpreter
  whose main module imports the CLI as the console script's does (bench/startup_probe.py);
- a small `kiln run`: the null model over a few images, the model registered first (not timed).
  The first run meets a new data dir (migrations); the row's `seconds` is the median of the runs
  after it (`startup_kiln_runs`), as a user's every later run. The first result and the engine
  are read from the run's own records: the earliest `finished_at` of the job's items, and when
  the worker recorded the model's engine (`engine_reports.updated_at`), each against the wall
  clock just before the command started.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.cases import embedded
from bench.context import Context
from bench.inputs import link_folder
from bench.results import CaseResult
from devstack.services import kiln_command, service_env
from kiln.app.core.config import embedded_urls

MODEL = "null"  # the ceiling's null model: a mean over a 64×64 image, an engine that costs nothing


def run(ctx: Context) -> CaseResult:
    plan = ctx.plan
    images = ctx.images[: plan.startup_images]
    folder = link_folder(ctx.workdir / "startup" / "images", images)
    data = ctx.workdir / "startup" / "data"
    shutil.rmtree(data, ignore_errors=True)
    env = service_env({**dict(plan.kiln_env), "KILN_DATA_DIR": str(data)})
    embedded.add_model(env, ctx.models[MODEL], ctx.workdir)
    runs = [_kiln_run(ctx, env, folder, data, n) for n in range(1 + plan.startup_kiln_runs)]
    first, later = runs[0], runs[1:]
    helps = [_help(env) for _ in range(plan.startup_runs)]
    preps = _prep_ready(env, plan.startup_runs, ctx.log_dir)
    extra = {
        "help_s": _median(helps),
        "prep_ready_s": _median([p["ready_s"] for p in preps]),
        "prep_cpu_s": _median([p["cpu_s"] for p in preps]),
        "prep_modules": preps[-1]["modules"],
        "prep_imports_pydantic": preps[-1]["pydantic"],
        "first_result_s": _median([r["first_result_s"] for r in later]),
        "engine_ready_s": _median([r["engine_ready_s"] for r in later]),
        "first_result_after_engine_s": _median([r["after_engine_s"] for r in later]),
        "first_run": first,  # a new data dir: its migrations ran in it
        "runs": later,
        "help_runs": helps,
    }
    return CaseResult(
        "startup",
        MODEL,
        items=len(images),
        seconds=_median([r["seconds"] for r in later]),
        cpu_seconds={"subject": _median([r["cpu_s"] for r in later])},
        extra=extra,
    )


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def _help(env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(kiln_command("run", "--help"), env=env, capture_output=True, check=True)
    return round(time.perf_counter() - started, 3)


def _prep_ready(env: dict[str, str], runs: int, log_dir: Path) -> list[dict[str, Any]]:
    command = [sys.executable, "-m", "bench.startup_probe", str(runs)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    (log_dir / "startup-prep.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the prep probe failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    answers: list[dict[str, Any]] = json.loads(proc.stdout.splitlines()[-1])
    return answers


def _kiln_run(
    ctx: Context, env: dict[str, str], folder: Path, data: Path, n: int
) -> dict[str, float]:
    output = data / f"results-{n}.parquet"
    command = kiln_command("run", str(folder), "--model", MODEL, "-o", str(output))
    with (ctx.log_dir / f"startup-run-{n}.log").open("wb") as log:
        wall, started = time.time(), time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        _pid, status, rusage = os.wait4(proc.pid, 0)  # CPU of the command and its children
        seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"kiln run failed; see {log.name}")
    embedded.check_output(output, len(list(folder.iterdir())))
    first, engine = _recorded(data)
    return {
        "seconds": round(seconds, 3),
        "cpu_s": round(rusage.ru_utime + rusage.ru_stime, 3),
        "first_result_s": round(first - wall, 3),
        "engine_ready_s": round(engine - wall, 3),
        "after_engine_s": round(first - engine, 3),
    }


def _recorded(data: Path) -> tuple[float, float]:
    """When the newest job's first item finished, and when the model's engine was recorded (as
    Unix times: SQLite holds them as UTC text)."""
    path = embedded_urls(data)["database_url"].removeprefix("sqlite:///")
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        (first,) = db.execute(
            "SELECT min(finished_at) FROM items WHERE job_id ="
            " (SELECT id FROM jobs ORDER BY created_at DESC LIMIT 1)"
        ).fetchone()
        (engine,) = db.execute(
            "SELECT max(updated_at) FROM engine_reports WHERE model LIKE ?", (f"{MODEL}:%",)
        ).fetchone()
    return _unix(first), _unix(engine)


def _unix(stamp: str) -> float:
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()
