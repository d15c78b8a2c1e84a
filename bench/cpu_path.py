"""Issue 38's CPU-path figure: the engine-owning process's CPU per row in `kiln run` with a
model that costs nothing, by thread, marginal over two sizes.

    python -m bench.cpu_path [--sizes 1000,3000] [--repeat 1] [--workdir .kiln/bench]

`kiln run FOLDER --model null8` over 640×480 JPEGs (feed's images; a folder of links), the
model an ONNX mean over an 8×8 input (`bench.models.null_model`), Kiln's defaults (the content
cache on; a fresh data dir per run, so nothing is found in it). The run's process is this
module's `_probed` wrapper: a thread of it reads every thread's CPU clock every SAMPLE_S (by
the thread's Python name) and writes them at exit; the process's own total is read from /proc
once it has exited (`feed._exited_own_cpu`), and what the threads' last reads leave of it
(threads that ended since a read, the interpreter's teardown) is "unread". Each figure is the
marginal, (cpu_large − cpu_small) ÷ (n_large − n_small) in µs a row, so start-up, model load
and teardown cancel. Prep (its children: decode, fit) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from bench.cases import embedded, feed, standin
from bench.inputs import link_folder, make_images
from bench.models import labels, null_model
from bench.stack import Registered
from devstack.services import service_env

SIDE = 8  # the model's input: nothing to compute, the fit still runs
MODEL = "null8"
SAMPLE_S = 0.05

# The probe: run as `python -c PROBE REPORT kiln-args...` (no main module for `spawn` to re-import
# in the prep processes). Its own thread is named and left out of the figures.
PROBE = r"""
import atexit, json, sys, threading, time
from pathlib import Path
report, sys.argv = sys.argv[1], ["kiln", *sys.argv[2:]]
cpu = {}
def read():
    names = {t.native_id: t.name for t in threading.enumerate()}
    for entry in Path("/proc/self/task").iterdir():
        tid = int(entry.name)
        try:
            seconds = time.clock_gettime(((~tid) << 3) | 6)
        except OSError:
            continue
        # a thread's Python name, kept once it has ended (joined threads linger in /proc)
        name = names.get(tid) or cpu.get(tid, (None,))[0]
        if name is None:
            try:
                name = "native:" + (entry / "comm").read_text().strip()
            except OSError:
                name = "native"
        cpu[tid] = (name, seconds)
def sample():
    while True:
        read()
        time.sleep(%(sample)r)
def write():
    read()
    Path(report).write_text(json.dumps([[t, n, s] for t, (n, s) in cpu.items()]))
threading.Thread(target=sample, name="cpu-path-probe", daemon=True).start()
atexit.register(write)
from kiln.app.cli import main
main()
"""

# Thread groups by the thread's Python name (first match wins), as the standin case groups them.
GROUPS = (
    ("chunk threads", re.compile(r"^ThreadPoolExecutor-")),
    ("batcher runners", re.compile(r"-runner-\d+$")),
    ("prep I/O", re.compile(r"^kiln-prep")),
    ("lease keeper", re.compile(r"^kiln-leases$")),
    ("celery worker", re.compile(r"^kiln-embedded-worker$")),
    ("warm-up", re.compile(r"^kiln-warm-up$")),
    ("main", re.compile(r"^MainThread$")),
    ("probe", re.compile(r"^cpu-path-probe$")),
)


def group(name: str) -> str:
    return standin.group_of(name, GROUPS, "other threads")


def run_once(workdir: Path, images: list[Path], model: Registered, tag: str) -> dict[str, Any]:
    """One `kiln run` over `images`: its wall seconds, its process's CPU by thread group and in
    total, its children's (prep) CPU."""
    items = len(images)
    folder = link_folder(workdir / "cpu-path" / f"links-{items}", images)
    data = workdir / "cpu-path" / f"run-{tag}-{items}"
    shutil.rmtree(data, ignore_errors=True)
    env = service_env({"KILN_DATA_DIR": str(data)})
    embedded.add_model(env, model, workdir)
    output = data / "results.parquet"
    report = data / "threads.json"
    probe = PROBE % {"sample": SAMPLE_S}
    args = ["run", str(folder), "--model", model.name, "-o", str(output)]
    command = [sys.executable, "-c", probe, str(report), *args]
    ran = feed.run_to_exit(command, env, data / "run.log")
    embedded.check_output(output, items)
    groups: dict[str, float] = {}
    for _tid, name, cpu in json.loads(report.read_text()):
        groups[group(name)] = groups.get(group(name), 0.0) + cpu
    probe_s = groups.pop("probe", 0.0)
    engine = ran.own_cpu - probe_s
    groups["unread"] = engine - sum(groups.values())
    return {"items": items, "seconds": ran.seconds, "engine": engine,
            "prep": ran.total_cpu - ran.own_cpu,
            "groups": groups}  # fmt: skip


def marginal(small: dict[str, Any], large: dict[str, Any]) -> dict[str, Any]:
    rows = large["items"] - small["items"]
    per_row = 1e6 / rows
    keys = sorted(set(small["groups"]) | set(large["groups"]))
    groups = {
        k: round((large["groups"].get(k, 0.0) - small["groups"].get(k, 0.0)) * per_row, 1)
        for k in keys
    }
    return {
        "rows": rows,
        "engine_us_per_row": round((large["engine"] - small["engine"]) * per_row, 1),
        "prep_us_per_row": round((large["prep"] - small["prep"]) * per_row, 1),
        "rows_per_s": round(rows / (large["seconds"] - small["seconds"]), 1),
        "engine_us_per_row_by_group": groups,
        "runs": [small, large],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,3000")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path(".kiln/bench"))
    parser.add_argument("--tag", default="now", help="names the data dirs and the output")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    small_n, large_n = (int(s) for s in args.sizes.split(","))
    folder = workdir / "images" / f"{feed.SIZE[0]}x{feed.SIZE[1]}-feed"
    images = make_images(folder, large_n, feed.SIZE)
    model = Registered(MODEL, null_model(workdir / "models" / f"null-{SIDE}.onnx", SIDE), SIDE,
                       labels(3))  # fmt: skip
    found = []
    for _ in range(args.repeat):
        small = run_once(workdir, images[:small_n], model, args.tag)
        large = run_once(workdir, images, model, args.tag)
        figures = marginal(small, large)
        found.append(figures)
        shown = {k: v for k, v in figures.items() if k != "runs"}
        print(json.dumps(shown, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
