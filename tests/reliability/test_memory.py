"""Memory stays flat over a long job: `kiln run` over 100,000 small items (about a minute), the
resident memory of the engine-owning process and of each prep process sampled while it runs.
Nothing per item may be kept: from two thirds of the way to the end — past the first tens of
thousands of items, in which allocators and caches reach their size — no process grows by more
than a few MB. `python -m bench.memory` is the same run with its figures (bench/README.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.memory import measure

ITEMS = int(os.environ.get("KILN_MEMORY_ITEMS", "100000"))
GROWTH_MB = {"engine": 24.0, "prep": 8.0}  # allowed growth over the last third of the run


# About a minute on a quiet 2-core host; 200-220 s on a slower one, more beside other load.
@pytest.mark.timeout(600)
def test_rss_is_flat_over_a_long_job(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    samples, _seconds = measure(tmp_path, ITEMS, env)
    # While prep processes ran (the run's last samples may be after they stopped).
    busy = [(t, found) for t, found in samples if any(r.startswith("prep") for r in found)]
    assert len(busy) >= 20, f"too few samples while the job ran: {len(busy)}"
    early, late = busy[2 * len(busy) // 3][1], busy[-1][1]
    for role, before in early.items():
        kind = "engine" if role == "engine" else "prep" if role.startswith("prep") else None
        if kind is None or role not in late:
            continue
        growth = late[role] - before
        assert growth < GROWTH_MB[kind], f"{role} grew {growth:.1f} MB over the job: {busy}"
