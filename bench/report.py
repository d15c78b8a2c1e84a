"""The results as a terminal table, a JSON file, a section of bench/README.md and a PNG chart."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import onnxruntime
import psutil
from rich.table import Table

from bench.results import CaseResult, Target

START, END = "<!-- bench:results:start -->", "<!-- bench:results:end -->"
COLUMNS = (
    "case", "model", "items", "s", "items/s", "÷ paired raw", "CPU s kiln/pg+redis/moto/driver",
    "subject CPU ms/item", "peak RSS MB", "latency p50/p99 ms", "mean batch",
)  # fmt: skip


def machine() -> dict[str, Any]:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "commit": commit or None,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _row(r: CaseResult) -> list[str]:
    if r.skipped:
        return [r.case, r.model, "–", "–", "skipped: " + r.skipped, *["–"] * (len(COLUMNS) - 5)]
    paired = r.extra.get("paired_raw_items_per_s")
    cpu = _cpu(r.cpu_seconds)
    per_item = r.subject_cpu_ms_per_item
    latency = f"{r.latency_ms['p50']:.0f}/{r.latency_ms['p99']:.0f}" if r.latency_ms else "–"
    mean = r.extra.get("mean_batch")
    return [
        r.case,
        r.model,
        str(r.items),
        f"{r.seconds:.1f}",
        f"{r.items_per_s:.1f}" if r.case not in ("idle", "startup") else "–",
        f"{r.items_per_s / paired:.2f}" if paired else "–",
        cpu or "–",
        f"{per_item:.2f}" if per_item is not None else "–",
        f"{r.peak_rss_mb.get('subject', 0):.0f}" if r.peak_rss_mb else "–",
        latency,
        f"{mean:.1f}" if mean else "–",
    ]


def _cpu(seconds: dict[str, float]) -> str:
    """Kiln/Postgres+Redis/moto/driver CPU seconds ("–" for a group not metered: moto where
    Kiln's store is local); a case with the subject alone shows that one figure."""
    if not set(seconds) & {"services", "moto", "driver"}:  # `feed`'s kiln run: engine/children
        return f"{seconds['subject']:.1f}" if "subject" in seconds else ""
    groups = ("subject", "services", "moto", "driver")
    return "/".join(f"{seconds[g]:.1f}" if g in seconds else "–" for g in groups)


def rich_table(results: list[CaseResult]) -> Table:
    table = Table(*COLUMNS, title="Kiln benchmark")
    for r in results:
        table.add_row(*_row(r))
    return table


def _verdict(t: Target) -> str:
    if t.informational:
        return "reported"
    return {True: "met", False: "**missed**", None: "not measured"}[t.met]


def markdown(results: list[CaseResult], goals: list[Target], info: dict[str, Any],
             command: str) -> str:  # fmt: skip
    lines = [
        f"Latest run: `{command}` on {info['date']}, commit `{info['commit']}` — {info['cpu']}, "
        f"{info['cores']} cores, {info['memory_gib']} GiB, Python {info['python']}, "
        f"ONNX Runtime {info['onnxruntime']}.",
        "",
        "| target | value | goal | |",
        "|---|---|---|---|",
        *(
            f"| {t.name} | {t.value if t.value is not None else '–'} | {t.goal} | {_verdict(t)} |"
            for t in goals
        ),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
        *("| " + " | ".join(_row(r)) + " |" for r in results),
        "",
        "![images/s per case](chart.png)",
    ]
    return "\n".join(lines)


def update_readme(readme: Path, section: str) -> None:
    text = readme.read_text() if readme.exists() else f"# Benchmarks\n\n{START}\n{END}\n"
    if START not in text:
        text += f"\n{START}\n{END}\n"
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    readme.write_text(pattern.sub(lambda _m: f"{START}\n{section}\n{END}", text))


def write_json(out_dir: Path, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def chart(results: list[CaseResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    shown = [
        r
        for r in results
        if not r.skipped and r.case not in ("idle", "raw-paired", "startup") and r.items_per_s > 0
    ]  # a marginal rate (`feed`) at tiny sizes may not be measurable: no bar on a log scale
    labels = [f"{r.case} · {r.model}" for r in shown]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(shown) + 1.2))
    colors = ["#c0392b" if r.case in ("services", "embedded", "ceiling", "ceiling-local",
                                      "bigjob", "feed-embedded", "feed-embedded-1prep",
                                      "feed-worker") or
              r.case.startswith("streaming") else "#7f8c8d" for r in shown]  # fmt: skip
    ax.barh(labels[::-1], [r.items_per_s for r in shown][::-1], color=colors[::-1])
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("items/s (log scale) — Kiln in red")
    ax.set_title("Kiln benchmark: throughput per case")
    for i, r in enumerate(shown[::-1]):
        ax.text(r.items_per_s, i, f" {r.items_per_s:.0f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
