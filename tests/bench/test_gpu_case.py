"""`bench.gpu` (issue 24, item 6): the whole case on the CPU at tiny sizes, so it can't rot
before a GPU host runs it, and its pure pieces (busy statistics, ratios and targets, the table,
the step runner's time limit). No timing assertions beyond "a rate was measured"."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu, gpu_parts, gpu_report, gpu_service

ROOT = Path(__file__).resolve().parents[2]
MEASURED_PARTS = ("native", "engine", "kiln", "peer", "detector", "decoders")  # `service` skips


@pytest.mark.timeout(330)  # ~1 minute on two idle cores; ResNet-50 on shared ones takes longer
def test_cpu_run_covers_every_part(tmp_path: Path) -> None:
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    command = [
        sys.executable, "-m", "bench.gpu", "--device", "cpu", "--workdir", str(tmp_path / "w"),
        "--out", str(out), "--markdown", str(md), "--images", "6", "--seconds", "0.2",
        "--max-batch", "1", "--budget", "300",
    ]  # fmt: skip
    # No database or broker named: the service part's rows say why not (tests/bench/
    # test_gpu_service.py runs it on real Postgres and Redis).
    env = {k: v for k, v in os.environ.items() if k not in gpu_service.URL_VARS}
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=320, env=env)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {n: p["status"] for n, p in report["parts"].items()} == dict.fromkeys(gpu.STEPS, "ok")
    rows = report["rows"]
    for part in MEASURED_PARTS:
        live = [r for r in rows if r["part"] == part and gpu_report.measured(r)]
        assert live, part
        for r in live:
            if "runs" in r:  # marginal (c, d, e): at 2 → 6 images the margin may be noise
                runs = r["runs"]["small"], r["runs"]["large"]
                assert [x["items"] for x in runs] == [2, 6] and all(x["seconds"] > 0 for x in runs)
                assert r["images_per_s"] > 0 or r["note"].startswith("noise"), r
            else:
                assert r["images_per_s"] > 0, r
                assert r["part"] == "decoders" or r["first_call_s"] > 0, r  # decoders: no call
            assert r["sm_busy"]["mean"] is None  # no NVML here: n/a, never a made-up figure
    subjects = {r["subject"]: r for r in rows}
    assert {"engine graphs=True", "engine graphs=False"} <= set(subjects)
    for name in ("kiln run, GPU decode", "kiln run, GPU decode, serial", "GPU decoders"):
        assert subjects[name]["skipped"].startswith("no GPU")
    staged = subjects[gpu_parts.STAGED_FED]  # the host stages ran (CPU streams)
    assert set(staged["stages"]) == {"upload", "forward", "outputs"}
    profiled = subjects[gpu_parts.PROFILED]  # py-spy over a whole kiln run (the dev extra's)
    assert profiled["images_per_s"] > 0 and profiled["seconds"] > 0
    summary = report["parts"]["profile"]["facts"]["summary"]
    assert "engine: 1 process(es)" in summary and "engine process, by thread group" in summary
    for name in ("kiln worker, ResNet-50", "kiln worker, detector"):
        assert subjects[name]["skipped"].startswith("no KILN_DATABASE_URL or KILN_BROKER_URL")
    assert subjects["engine graphs=True"]["reference"] == "native@1"
    assert all(r["met"] is None for r in rows)  # GPU targets are not judged on a CPU
    assert "replays graphs graphs=True" in report["parts"]["engine"]["facts"]
    text = md.read_text()
    assert "| subject | batch | images/s |" in text and "· device cpu ·" in text
    assert all(name in text for name in subjects)


def test_batches_skip_and_timeouts() -> None:
    assert gpu_parts.native_batches(256) == [16, 64, 256]
    assert gpu_parts.native_batches(32) == [16, 32]
    assert gpu.parse_skip("a, c,worker") == {"native", "kiln", "service"}
    assert gpu.parse_skip("f") == {"service"}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown parts"):
        gpu.parse_skip("z")
    assert gpu.parse_timeouts("b=200")["engine"] == 200
    assert gpu.parse_timeouts("")["kiln"] == gpu.TIMEOUT_S["kiln"]


def test_a_step_past_its_limit_is_killed_with_its_tree_and_keeps_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's child writes a row, starts a grandchild (as a part starts `kiln run`), then
    hangs: the limit ends both, and the row survives."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/bash\n"
        'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
        """echo '{"rows": [{"part": "native"}], "facts": {}}' > "$out"\n"""
        'sleep 60 & echo $! > "$out.pid"\n'
        "sleep 60\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(gpu, "MIN_STEP_S", 0)
    s = gpu_parts.Settings(tmp_path, "cpu", 6, 0.2, 1, "onnxruntime-cpu", frozenset())
    started = time.monotonic()
    part = gpu.run_step("native", s, timeout=1)
    assert time.monotonic() - started < 10
    assert (part["status"], part["rows"]) == ("timeout", [{"part": "native"}])
    grandchild = int((tmp_path / "part-native.json.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failed_subject_becomes_its_row_and_the_part_goes_on(tmp_path: Path) -> None:
    sink = gpu_parts.Sink(tmp_path / "part.json")

    def broken() -> None:
        raise RuntimeError("kiln run failed; see kiln.log")

    gpu_parts.attempt(sink, "kiln", "kiln run, GPU decode", broken)
    gpu_parts.attempt(sink, "kiln", "kiln run, CPU decode", lambda: sink.add({"part": "kiln"}))
    written = json.loads((tmp_path / "part.json").read_text())["rows"]
    assert written[0]["failed"] == "RuntimeError: kiln run failed; see kiln.log"
    assert written[1] == {"part": "kiln"} and not gpu_report.measured(written[0])
