"""`gpu` (issue 24, item 6): a GPU benchmark that measures the GPU. How close Kiln's engine and
`kiln run` come to what the card does with ResNet-50 in plain torch, with NVML's busy share
beside every figure, in one run and one process tree.

    python -m bench.gpu --workdir DIR --out FILE.json [--markdown FILE.md] [--images 6000]
        [--seconds 1.5] [--device cuda|cpu] [--skip a,b,...] [--budget 520]
        [--database-url URL --broker-url URL]   (default: KILN_DATABASE_URL, KILN_BROKER_URL)

Parts (ResNet-50 with the bench's seed-0 weights, bench/models.py):
a. `native`, the limit: the module in plain torch, FP16 + channels_last (cuDNN autotuned),
   input already on the device, at batch 16, 64 and 256.
b. `engine`: Kiln's torch engine object over the same ResNet-50 exported to ONNX (onnx2fx),
   fed host uint8 NHWC batches as Kiln's prep processes feed it, at every bucket it captures a
   CUDA graph for (`cuda_graphs.buckets`: 1, 2, 4, … and the largest batch); at 16/64/256 as
   a worker feeds it (two runner threads gathering into its staging) and without graphs; each
   build (the convert) timed.
c. `kiln`: `kiln run` from 640×480 JPEG bytes, nvJPEG and CPU decode (bench/gpu_feed.py).
d. `peer`: a PyTorch DataLoader feeding the plain-torch module (bench/gpu_feed.py).
e. `detector`: Kiln's built-in detector, `kiln run --model detector` over the same JPEGs.
f. `service` (issue 32): Kiln as a service where a database and a broker are named
   (`KILN_DATABASE_URL`, `KILN_BROKER_URL`: Postgres and Redis): `kiln api` and `kiln worker`
   (`--devices all` on a GPU: one pinned process per device), ResNet-50 and the detector over
   the same JPEGs, each size uploaded over HTTP as one job and followed to its close, every
   item's result checked to be there exactly once; the rate is judged against `kiln run`'s on
   the same model (bench/gpu_service.py). Without the URLs its rows say why not.
g. `decoders` (issue 33): each GPU JPEG decoder (nvImageCodec, torchvision's nvJPEG) at 1, 2
   and 4 threads, decode alone and decode + fit, and every core decoding as prep does
   (bench/gpu_decoders.py).
h. `profile` (issue 33's next step): one `kiln run` of the large folder under py-spy (`--gil
   --subprocesses`), summarised per process, thread group and function (bench/gpu_profile.py;
   needs py-spy on PATH: the bundle's `profile` part).
Issue 33's rows beside them: `kiln run` with the device stages (the default) and with
`KILN_DEVICE_PIPELINE=serial` (before it), and the engine fed by the host stages with
each stage's busy/starved/blocked seconds.

How: a and b time back-to-back calls for `--seconds` after a warm-up (the first call timed
apart: cuDNN autotuning, graph capture), synchronised at the end: images/s = calls × batch /
elapsed. c to f are marginal rates over two sizes (a third and all of the images), so
start-up and model load cancel. While each runs, a thread reads NVML's utilisation every 50 ms
(the share of time some kernel ran, not SM occupancy); mean and p50 are over the steady part,
from the first to the last busy sample, so start-up and tear-down with the GPU idle are cut
off. Without NVML (a CPU host) they read "n/a".

Each part runs in a child process under its own time limit (and all within `--budget`), writing
its rows as they come; the JSON and markdown are rewritten after each part, so a stuck part
costs only its own limit and what was measured before it survives. `--device cpu` runs it all
on the CPU at small sizes (the tests); the targets are GPU targets and are not judged there.

This module is the driver and the command line; the parts are `bench/gpu_parts.py`, the rows'
targets, the table and the JSON `bench/gpu_report.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import fields
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.gpu_parts import PART_FUNCTIONS, Settings, Sink
from bench.gpu_report import all_rows, markdown, save

PARTS = {"a": "native", "b": "engine", "c": "kiln", "d": "peer", "e": "detector", "f": "service",
         "g": "decoders", "h": "profile"}  # fmt: skip
ALIASES = {"worker": "service"}  # `--skip worker`, from before the service path was a part
STEPS = ("prepare", *PARTS.values())
# Seconds per step on a GPU host; `--budget` caps their sum.
TIMEOUT_S = {"prepare": 60, "native": 45, "engine": 150, "kiln": 200, "peer": 45, "detector": 90,
             "service": 180, "decoders": 90, "profile": 90}  # fmt: skip
MIN_STEP_S = 10  # with less budget left, a step is skipped rather than started and killed


def parse_skip(text: str) -> frozenset[str]:
    """`a,c` or `native,kiln` (and `worker`: the service part) → step names."""
    tokens = (token.strip() for token in text.split(","))
    names = {ALIASES.get(t, PARTS.get(t, t)) for t in tokens if t}
    unknown = names - set(STEPS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown parts {sorted(unknown)}; use a-f or names")
    return frozenset(names)


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
    settings = {**_settings_dict(s), "service": service_urls()}
    report: dict[str, Any] = {"host": host(s.device), "settings": settings, "parts": {}}
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


def _settings_dict(s: Settings) -> dict[str, Any]:
    return {**{f.name: getattr(s, f.name) for f in fields(s)}, "workdir": str(s.workdir),
            "skip": sorted(s.skip)}  # fmt: skip


def service_urls() -> dict[str, str | None]:
    """The database and broker the service part runs on (passwords hidden), as the children
    read them from the environment."""
    from kiln.app.core.config import redact_url

    return {name: redact_url(os.environ[name]) if os.environ.get(name) else None
            for name in ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORAGE_URL")}  # fmt: skip


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
    p.add_argument("--skip", type=parse_skip, default=frozenset(), help="a-f or names")
    p.add_argument("--budget", type=float, default=520, help="seconds for all parts together")
    p.add_argument("--database-url", help="Postgres of the service part (KILN_DATABASE_URL)")
    p.add_argument("--broker-url", help="Redis of the service part (KILN_BROKER_URL)")
    p.add_argument("--timeouts", type=parse_timeouts, default=dict(TIMEOUT_S), help="native=60,…")
    p.add_argument("--part", choices=STEPS, help=argparse.SUPPRESS)  # a child: one part
    return p


def main() -> None:
    args = parser().parse_args()
    urls = {"KILN_DATABASE_URL": args.database_url, "KILN_BROKER_URL": args.broker_url}
    for name, given in urls.items():
        if given:  # the parts' children (and the Kiln processes they start) inherit them
            os.environ[name] = given
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
