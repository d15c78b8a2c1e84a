"""Kiln embedded: `kiln run FOLDER --model M` — SQLite, a local store, the filesystem broker.

Timed as a user would time it: the whole command, start-up and model load included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq

from bench.context import Context
from bench.measure import Meter
from bench.results import CaseResult
from bench.stack import Registered
from devstack.services import kiln_command, service_env


def run(ctx: Context, model: str) -> CaseResult:
    info = ctx.models[model]
    data = ctx.workdir / "embedded" / model
    shutil.rmtree(data, ignore_errors=True)
    env = service_env({**dict(ctx.plan.kiln_env), "KILN_DATA_DIR": str(data)})
    add_model(env, info, ctx.workdir)
    output = data / "results.parquet"
    log = (ctx.log_dir / f"embedded-{model}.log").open("wb")
    command = kiln_command("run", str(ctx.image_folder), "--model", model, "-o", str(output))
    with log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        with Meter({"subject": [proc.pid]}).window() as usage:
            # wait4 gives the CPU of the process and its reaped children, read as it exits.
            _pid, status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
        usage.cpu_seconds["subject"] = round(rusage.ru_utime + rusage.ru_stime, 3)
    if code != 0:
        raise RuntimeError(f"kiln run failed (exit {code}); see {log.name}")
    check_output(output, len(ctx.images))
    return CaseResult.from_usage(
        "embedded", model, len(ctx.images), usage, extra={"includes": "start-up and model load"}
    )


def add_model(env: dict[str, str], info: Registered, workdir: Path) -> None:
    """`kiln models add` into the embedded Kiln that `env` names (not timed by any case)."""
    labels = workdir / f"{info.name}.labels.txt"
    labels.write_text("\n".join(info.labels) + "\n")
    add = ["models", "add", info.name, "--onnx", str(info.onnx)]
    _kiln(env, *add, "--input-size", str(info.input_size), "--labels", str(labels))


def check_output(output: Path, expected: int) -> None:
    """Every one of `expected` items succeeded, as `kiln run`'s Parquet says."""
    table = pq.read_table(output)
    succeeded = table.column("status").to_pylist().count("succeeded")
    if succeeded != expected:
        raise RuntimeError(f"kiln run: {succeeded} of {expected} items succeeded")


def _kiln(env: dict[str, str], *args: str) -> None:
    proc = subprocess.run(kiln_command(*args), env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args[:2])} failed: {proc.stderr.strip()}")
