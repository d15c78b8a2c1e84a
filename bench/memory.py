"""Memory over a long job (issue 23): the resident memory of every process of `kiln run` —
the engine-owning process and each prep process — sampled while one job of many items runs.
Flat means nothing per item is kept: a leak shows as growth between the samples.

    python -m bench.memory [--items 100000] [--workdir .kiln/bench]

The items are hard links to 8 small PNGs (distinct keys, cheap to make), the model the bench's
null model at 64 px, the content cache off. Prints RSS in MB per process at 10%, 50% and 90%
of the run and at its peak, and writes the samples beside the workdir's other results.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from PIL import Image

from bench.models import labels, null_model

SIDE = 64
DISTINCT = 8


def inputs(folder: Path, items: int) -> Path:
    """`items` hard links named 000000.png, … to DISTINCT small PNGs."""
    originals = folder / "originals"
    links = folder / f"items-{items}"
    if links.is_dir() and sum(1 for _ in links.iterdir()) == items:
        return links
    shutil.rmtree(links, ignore_errors=True)
    originals.mkdir(parents=True, exist_ok=True)
    links.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(DISTINCT):
        buffer = io.BytesIO()
        pixels = rng.integers(0, 255, (SIDE, SIDE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, "PNG")
        (originals / f"{i}.png").write_bytes(buffer.getvalue())
    for i in range(items):
        os.link(originals / f"{i % DISTINCT}.png", links / f"{i:06d}.png")
    return links


def sample(proc: psutil.Process) -> dict[str, float]:
    """RSS in MB of the process (`engine`) and of each child: its prep processes (started by
    multiprocessing's spawn) as `prep-<pid>`, anything else as `other-<pid>`."""
    found = {"engine": proc.memory_info().rss / 2**20}
    for child in proc.children(recursive=True):
        try:
            prep = "spawn_main" in " ".join(child.cmdline())
            found[f"{'prep' if prep else 'other'}-{child.pid}"] = child.memory_info().rss / 2**20
        except psutil.Error:
            continue
    return found


Samples = list[tuple[float, dict[str, float]]]  # (seconds since the start, RSS MB by role)


def measure(work: Path, items: int, env: dict[str, str]) -> tuple[Samples, float]:
    """`kiln run` over `items` inputs made in `work` (a fresh data dir there), sampled every
    0.5 s while it runs; the samples and the run's seconds."""
    folder = inputs(work, items)
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    env = {**env, "KILN_DATA_DIR": str(data), "KILN_CONTENT_CACHE": "false"}
    onnx = null_model(work / f"null-{SIDE}.onnx", SIDE)
    names = work / "labels.txt"
    names.write_text("\n".join(labels(3)) + "\n")
    kiln = [sys.executable, "-m", "kiln.app.cli"]
    add = [*kiln, "models", "add", "null", "--onnx", str(onnx), "--input-size", str(SIDE)]
    subprocess.run([*add, "--labels", str(names)], env=env, check=True, capture_output=True)
    run = [*kiln, "run", str(folder), "--model", "null", "-o", str(data / "out.parquet")]
    started = time.monotonic()
    log = work / "run.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(run, env=env, stdout=out, stderr=subprocess.STDOUT)
    watched, samples = psutil.Process(proc.pid), []
    while proc.poll() is None:
        try:
            samples.append((time.monotonic() - started, sample(watched)))
        except psutil.Error:
            break
        time.sleep(0.5)
    if proc.returncode != 0:
        raise RuntimeError(f"kiln run failed: {log.read_text()[-3000:]}")
    return samples, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--workdir", type=Path, default=Path(".kiln/bench"))
    args = parser.parse_args()
    work = args.workdir / "memory"
    samples, seconds = measure(work, args.items, dict(os.environ))
    report = summary(samples, seconds, args.items)
    (work / "memory.json").write_text(json.dumps({"summary": report, "samples": samples}))
    print(json.dumps(report, indent=2))


def summary(
    samples: list[tuple[float, dict[str, float]]], seconds: float, items: int
) -> dict[str, Any]:
    """RSS per process at 10%, 50% and 90% of the run, and its peak."""
    at = {}
    for share in (0.1, 0.5, 0.9):
        when = seconds * share
        at[f"{int(share * 100)}%"] = min(samples, key=lambda s: abs(s[0] - when))[1]
    roles = sorted({role for _t, found in samples for role in found})
    peak = {r: max(found.get(r, 0.0) for _t, found in samples) for r in roles}
    return {
        "items": items,
        "seconds": round(seconds, 1),
        "items_per_s": round(items / seconds, 1),
        "rss_mb": {
            role: {k: round(v.get(role, 0.0), 1) for k, v in at.items()}
            | {"peak": round(peak[role], 1)}
            for role in roles
        },
    }


if __name__ == "__main__":
    main()
