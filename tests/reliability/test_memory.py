"""Memory stays flat over a long job: `kiln run` over 100,000 small items (about a minute), the
resident memory of the engine-owning process and of each prep process sampled while it runs.
Nothing per item may be kept: from two thirds of the way to the end — past the first tens of
thousands of items, in which allocators and caches reach their size — no process grows by more
than a few MB. `python -m bench.memory` is the same run with its figures (bench/README.md).
"""

from __future__ import annotations

import os
from itertools import pairwise
from pathlib import Path

import pytest

from bench.memory import measure

ITEMS = int(os.environ.get("KILN_MEMORY_ITEMS", "100000"))
GROWTH_MB = {"engine": 24.0, "prep": 8.0}  # allowed growth over the last third of the run
# Allocators grow in steps, not per item: a 26 MB step of the engine's heap lands in one 0.5 s
# sample (measured), and whether it falls in the last third is chance. A leak is a climb spread
# over the samples, so the largest STEPS jumps are set aside before the growth is judged.
STEPS = 2


def growth_past_steps(series: list[float]) -> float:
    """How much `series` grew from first to last, less its STEPS largest sample-to-sample rises."""
    rises = sorted(max(0.0, b - a) for a, b in pairwise(series))
    return series[-1] - series[0] - sum(rises[-STEPS:])


# About a minute on a quiet 2-core host; 200-220 s on a slower one, more beside other load.
@pytest.mark.timeout(600)
def test_rss_is_flat_over_a_long_job(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    samples, _seconds = measure(tmp_path, ITEMS, env)
    # While prep processes ran (the run's last samples may be after they stopped).
    busy = [(t, found) for t, found in samples if any(r.startswith("prep") for r in found)]
    assert len(busy) >= 20, f"too few samples while the job ran: {len(busy)}"
    last_third = [found for _t, found in busy[2 * len(busy) // 3 :]]
    for role in last_third[0]:
        kind = "engine" if role == "engine" else "prep" if role.startswith("prep") else None
        series = [found[role] for found in last_third if role in found]
        if kind is None or len(series) < 2:
            continue
        growth = growth_past_steps(series)
        assert growth < GROWTH_MB[kind], f"{role} grew {growth:.1f} MB over the job: {busy}"


def test_an_allocator_step_is_set_aside_and_a_climb_is_not() -> None:
    step = [500.0] * 10 + [526.0] * 10  # one arena step: not a leak
    assert growth_past_steps(step) == 0.0
    climb = [500.0 + 0.4 * i for i in range(100)]  # 0.4 MB a sample: a leak
    assert growth_past_steps(climb) > 24.0
