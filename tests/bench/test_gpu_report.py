"""`bench.gpu_report`: busy statistics, ratios and targets, and the markdown table of the GPU
case's report (pure: no GPU, no child process)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import gpu_report
from bench.gpu_feed import Run, device_stages_verdicts


def test_steady_part_drops_idle_start_and_end() -> None:
    assert gpu_report.steady([0, 0, 40, 0, 90, 0]) == [40, 0, 90]
    assert gpu_report.steady([0, 0]) == [0, 0]  # never busy: a mean of 0, not n/a
    assert gpu_report.busy_stats([0, 10, 20, 90, 0]) == {"mean": 40.0, "p50": 20, "samples": 3}
    assert gpu_report.busy_stats([]) == {"mean": None, "p50": None, "samples": 0}


def test_marginal_busy_cancels_start_up() -> None:
    small = Run(100, 2.0, 1.0, [50.0] * 4)  # 1 busy second (the warm-up sweep and the run)
    large = Run(400, 4.0, 2.0, [75.0] * 8)  # 3 busy seconds
    assert gpu_report.marginal_busy(small, large) == 100.0  # the 2 extra seconds were all busy
    assert gpu_report.marginal_busy(Run(1, 2.0, 1.0, []), large) is None
    assert gpu_report.marginal_busy(large, small) is None


def _live(part: str, subject: str, batch: int | None, rate: float, busy: float) -> gpu_report.Row:
    return {**gpu_report.row(part, subject, batch, rate, [busy]), "graphs": True}


ROWS = [
    _live("native", "native", 16, 12_000, 95),
    _live("native", "native", 64, 16_000, 99),
    _live("engine", "engine graphs=True", 16, 10_500, 90),
    _live("engine", "engine graphs=True", 64, 13_000, 92),
    _live("kiln", "kiln run, GPU decode", None, 9_000, 85),
    _live("peer", "DataLoader peer", None, 3_000, 40),
    _live("detector", "detector, kiln run", None, 1_500, 30),
    gpu_report.skipped("service", "kiln worker, detector", "no KILN_DATABASE_URL: …"),
]
SERVICE = {
    **gpu_report.row("service", "kiln worker, ResNet-50", None, 8_280, [80]),
    "versus": "kiln run, GPU decode",
    "submit_s": {"small": 0.9, "large": 2.7},
    "images_per_s_with_upload": 3_120.5,
    "results": {"large": {"inputs": 6_000, "distinct_keys": 6_000, "succeeded": 6_000}},
}


def test_ratios_and_targets_are_judged_on_a_gpu_only() -> None:
    rows = {r["subject"] + str(r["batch"]): r for r in gpu_report.annotate(ROWS, "cuda")}
    at16, at64 = rows["engine graphs=True16"], rows["engine graphs=True64"]
    assert (at16["reference"], at16["ratio"], at16["met"]) == ("native@16", 0.875, True)
    assert (at64["ratio"], at64["target"], at64["met"]) == (0.812, "≥ 0.85× native", False)
    run = rows["kiln run, GPU decodeNone"]
    assert (run["reference"], run["ratio"], run["met"]) == ("peer", 3.0, True)
    assert rows["detector, kiln runNone"]["met"] is False  # 1,500 < 5 × 375
    assert rows["kiln worker, detectorNone"]["ratio"] is None
    assert all(r["met"] is None for r in gpu_report.annotate(ROWS, "cpu"))


def test_markdown_table() -> None:
    report = {
        "host": {"gpu": "NVIDIA H200", "torch": "2.11.0", "cores": 16, "device": "cuda",
                 "utc": "2026-01-01 00:00 UTC"},
        "parts": {"native": {"status": "ok", "seconds": 20.0, "rows": ROWS},
                  "engine": {"status": "timeout", "seconds": 120.0, "rows": [],
                             "facts": {"build_s graphs=True": 6.1}}},
    }  # fmt: skip
    lines = gpu_report.markdown(report).splitlines()
    assert "Host: NVIDIA H200 · torch 2.11.0 · 16 cores · device cuda" in lines[2]
    engine = (
        "| engine graphs=True | 64 | 13,000 | 0.81× native@64 | 92 | 92 | ≥ 0.85× native | no |"
    )
    assert engine in lines
    assert "| native | 16 | 12,000 | reference | 95 | 95 |  | – |" in lines
    worker = "| kiln worker, detector | – | skipped: no KILN_DATABASE_URL: … |"
    assert any(line.startswith(worker) for line in lines)
    assert "Steps: native ok 20 s · engine timeout 120 s" in lines
    assert "Engine: build_s graphs=True 6.1" in lines


def test_eager_rows_are_the_comparison_and_worker_fed_rows_are_judged_on_the_ratio() -> None:
    eager = {**gpu_report.row("engine", "engine graphs=False", 64, 9_000, [90]), "graphs": False}
    fed = [
        gpu_report.row("engine", "engine as a worker feeds it", b, 13_600, [95]) for b in (16, 64)
    ]
    judged = gpu_report.annotate([*ROWS[:2], eager, *fed], "cuda")[2:]
    assert [r["target"] for r in judged] == [None, None, "≥ 0.85× native"]
    assert (judged[0]["ratio"], judged[2]["ratio"], judged[2]["met"]) == (0.562, 0.85, True)


def test_a_service_row_is_judged_against_the_kiln_run_it_names() -> None:
    judged = {r["subject"]: r for r in gpu_report.annotate([*ROWS, SERVICE], "cuda")}
    worker = judged["kiln worker, ResNet-50"]
    assert (worker["reference"], worker["ratio"], worker["met"]) == (
        "kiln run, GPU decode",
        0.92,
        True,
    )
    assert worker["target"] == "≥ 0.9× kiln run, every item once"
    slow = {**SERVICE, "images_per_s": 8_000}
    assert gpu_report.annotate([*ROWS, slow], "cuda")[-1]["met"] is False  # 0.89×
    noisy_run = [{**r, "note": "noise (large run not slower)"} if r["part"] == "kiln" else r
                 for r in ROWS]  # fmt: skip
    assert gpu_report.annotate([*noisy_run, SERVICE], "cuda")[-1]["ratio"] is None
    skipped = judged["kiln worker, detector"]
    assert (skipped["ratio"], skipped["met"]) == (None, None)


def test_markdown_says_how_the_service_ran() -> None:
    report = {
        "host": {"gpu": None, "torch": "2.11.0", "cores": 2, "device": "cpu",
                 "utc": "2026-01-01 00:00 UTC"},
        "parts": {"kiln": {"status": "ok", "seconds": 20.0, "rows": ROWS[4:5]},
                  "service": {"status": "ok", "seconds": 60.0, "rows": [SERVICE, ROWS[-1]],
                              "facts": {"store": "local folder", "workers": "kiln worker"}}},
    }  # fmt: skip
    lines = gpu_report.markdown(report).splitlines()
    row = "| kiln worker, ResNet-50 | – | 8,280 | 0.92× kiln run, GPU decode | 80 | 80 |"
    assert any(line.startswith(row) for line in lines), lines
    assert "Service: store: local folder · workers: kiln worker" in lines
    assert (
        "kiln worker, ResNet-50: upload 0.9 / 2.7 s before each job's answer (small / large), "
        "3,120.5 images/s with it; results 6,000 keys of 6,000, each once, 6,000 succeeded"
    ) in lines


def test_a_kiln_run_row_carries_what_its_device_stages_said(tmp_path: Path) -> None:
    """The engine process logs each model's device stages' verdict as they close; bench.gpu keeps
    those lines of the large run and the markdown shows them under the table."""
    said = (
        "resnet50-device pipeline closed: 9.8 s with batches inside; busy per thread: "
        "decode 97%, fit 31%, forward 12%, outputs 20%; decode held the others back"
    )
    log = tmp_path / "kiln.log"
    log.write_text(
        "\n".join([
            "Running here, embedded (SQLite and files under /x).",  # the command's own line
            json.dumps({"level": "INFO", "logger": "kiln.workers.runtime", "message": "ok"}),
            json.dumps({"level": "INFO", "logger": "kiln.workers.device.stages",
                        "message": said + "; per stage: {}"}),
            "[1, 2]",  # JSON, not an object
        ]) + "\n"
    )  # fmt: skip
    assert device_stages_verdicts(log) == [said + "; per stage: {}"]
    kiln = {**ROWS[4], "pipelines": [said]}
    report = {
        "host": {"gpu": None, "torch": "2.11.0", "cores": 2, "device": "cpu",
                 "utc": "2026-01-01 00:00 UTC"},
        "parts": {"kiln": {"status": "ok", "seconds": 20.0, "rows": [kiln]}},
    }  # fmt: skip
    assert f"{kiln['subject']} (large run): {said}" in gpu_report.markdown(report).splitlines()
