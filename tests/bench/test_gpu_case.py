"""`bench.gpu` (issue 24, item 6): the whole case on the CPU at tiny sizes, so it can't rot
before a GPU host runs it, and its pure pieces (busy statistics, ratios and targets, the table,
the step runner's time limit). No timing assertions beyond "a rate was measured"."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu
from bench.gpu_feed import Run

ROOT = Path(__file__).resolve().parents[2]
MEASURED_PARTS = ("native", "engine", "kiln", "peer", "detector")


@pytest.mark.timeout(330)  # ~1 minute on two idle cores; ResNet-50 on shared ones takes longer
def test_cpu_run_covers_every_part(tmp_path: Path) -> None:
    out, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    command = [
        sys.executable, "-m", "bench.gpu", "--device", "cpu", "--workdir", str(tmp_path / "w"),
        "--out", str(out), "--markdown", str(md), "--images", "6", "--seconds", "0.2",
        "--max-batch", "1", "--skip", "worker", "--budget", "300",
    ]  # fmt: skip
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=320)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {n: p["status"] for n, p in report["parts"].items()} == dict.fromkeys(gpu.STEPS, "ok")
    rows = report["rows"]
    for part in MEASURED_PARTS:
        live = [r for r in rows if r["part"] == part and gpu.measured(r)]
        assert live, part
        for r in live:
            if "runs" in r:  # marginal (c, d, e): at 2 → 6 images the margin may be noise
                runs = r["runs"]["small"], r["runs"]["large"]
                assert [x["items"] for x in runs] == [2, 6] and all(x["seconds"] > 0 for x in runs)
                assert r["images_per_s"] > 0 or r["note"].startswith("noise"), r
            else:
                assert r["images_per_s"] > 0 and r["first_call_s"] > 0, r
            assert r["sm_busy"]["mean"] is None  # no NVML here: n/a, never a made-up figure
    subjects = {r["subject"]: r for r in rows}
    assert {"engine graphs=True", "engine graphs=False"} <= set(subjects)
    assert subjects["kiln run, GPU decode"]["skipped"].startswith("no GPU")
    assert subjects["kiln worker, CPU decode"]["skipped"] == "--skip worker"
    assert subjects["engine graphs=True"]["reference"] == "native@1"
    assert all(r["met"] is None for r in rows)  # GPU targets are not judged on a CPU
    assert report["parts"]["engine"]["facts"]["input"].startswith("uint8")
    text = md.read_text()
    assert "| subject | batch | images/s |" in text and "· device cpu ·" in text
    assert all(name in text for name in subjects)


def test_steady_part_drops_idle_start_and_end() -> None:
    assert gpu.steady([0, 0, 40, 0, 90, 0]) == [40, 0, 90]
    assert gpu.steady([0, 0]) == [0, 0]  # never busy: a mean of 0, not n/a
    assert gpu.busy_stats([0, 10, 20, 90, 0]) == {"mean": 40.0, "p50": 20, "samples": 3}
    assert gpu.busy_stats([]) == {"mean": None, "p50": None, "samples": 0}


def test_marginal_busy_cancels_start_up() -> None:
    small = Run(100, 2.0, 1.0, [50.0] * 4)  # 1 busy second (the warm-up sweep and the run)
    large = Run(400, 4.0, 2.0, [75.0] * 8)  # 3 busy seconds
    assert gpu.marginal_busy(small, large) == 100.0  # the 2 extra seconds were all busy
    assert gpu.marginal_busy(Run(1, 2.0, 1.0, []), large) is None
    assert gpu.marginal_busy(large, small) is None


def test_batches_skip_and_timeouts() -> None:
    assert gpu.buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert gpu.buckets(5) == [1, 2, 4]
    assert gpu.native_batches(256) == [16, 64, 256]
    assert gpu.native_batches(32) == [16, 32]
    assert gpu.parse_skip("a, c,worker") == {"native", "kiln", "worker"}
    with pytest.raises(argparse.ArgumentTypeError, match="unknown parts"):
        gpu.parse_skip("z")
    assert gpu.parse_timeouts("b=200")["engine"] == 200
    assert gpu.parse_timeouts("")["kiln"] == gpu.TIMEOUT_S["kiln"]


def _live(part: str, subject: str, batch: int | None, rate: float, busy: float) -> gpu.Row:
    return {**gpu.row(part, subject, batch, rate, [busy]), "graphs": True}


ROWS = [
    _live("native", "native", 16, 12_000, 95),
    _live("native", "native", 64, 16_000, 99),
    _live("engine", "engine graphs=True", 16, 10_500, 90),
    _live("engine", "engine graphs=True", 64, 13_000, 92),
    _live("kiln", "kiln run, GPU decode", None, 9_000, 85),
    gpu.skipped("kiln", "kiln worker, CPU decode", "Postgres or Redis does not answer"),
    _live("peer", "DataLoader peer", None, 3_000, 40),
    _live("detector", "detector, kiln run", None, 1_500, 30),
]


def test_ratios_and_targets_are_judged_on_a_gpu_only() -> None:
    rows = {r["subject"] + str(r["batch"]): r for r in gpu.annotate(ROWS, "cuda")}
    at16, at64 = rows["engine graphs=True16"], rows["engine graphs=True64"]
    assert (at16["reference"], at16["ratio"], at16["met"]) == ("native@16", 0.875, True)
    assert (at64["ratio"], at64["target"], at64["met"]) == (0.812, "≥ 0.85× native", False)
    run = rows["kiln run, GPU decodeNone"]
    assert (run["reference"], run["ratio"], run["met"]) == ("peer", 3.0, True)
    assert rows["detector, kiln runNone"]["met"] is False  # 1,500 < 5 × 375
    assert rows["kiln worker, CPU decodeNone"]["ratio"] is None
    assert all(r["met"] is None for r in gpu.annotate(ROWS, "cpu"))


def test_markdown_table() -> None:
    report = {
        "host": {"gpu": "NVIDIA H200", "torch": "2.11.0", "cores": 16, "device": "cuda",
                 "utc": "2026-01-01 00:00 UTC"},
        "parts": {"native": {"status": "ok", "seconds": 20.0, "rows": ROWS},
                  "engine": {"status": "timeout", "seconds": 120.0, "rows": [],
                             "facts": {"build_s graphs=True": 6.1}}},
    }  # fmt: skip
    lines = gpu.markdown(report).splitlines()
    assert "Host: NVIDIA H200 · torch 2.11.0 · 16 cores · device cuda" in lines[2]
    engine = (
        "| engine graphs=True | 64 | 13,000 | 0.81× native@64 | 92 | 92 | ≥ 0.85× native | no |"
    )
    assert engine in lines
    assert "| native | 16 | 12,000 | reference | 95 | 95 |  | – |" in lines
    worker = "| kiln worker, CPU decode | – | skipped: Postgres or Redis does not answer |"
    assert any(line.startswith(worker) for line in lines)
    assert "Steps: native ok 20 s · engine timeout 120 s" in lines
    assert "Engine: build_s graphs=True 6.1" in lines


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
    s = gpu.Settings(tmp_path, "cpu", 6, 0.2, 1, "onnxruntime-cpu", frozenset())
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
    sink = gpu.Sink(tmp_path / "part.json")

    def broken() -> None:
        raise RuntimeError("kiln run failed; see kiln.log")

    gpu.attempt(sink, "kiln", "kiln run, GPU decode", broken)
    gpu.attempt(sink, "kiln", "kiln run, CPU decode", lambda: sink.add({"part": "kiln"}))
    written = json.loads((tmp_path / "part.json").read_text())["rows"]
    assert written[0]["failed"] == "RuntimeError: kiln run failed; see kiln.log"
    assert written[1] == {"part": "kiln"} and not gpu.measured(written[0])
