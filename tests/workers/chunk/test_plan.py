"""How a chunk's rows are cut into prep units, with the content cache on and off."""

from __future__ import annotations

import numpy as np

from kiln.workers.chunk.answer import plan_prepare, plan_units
from kiln.workers.prep.units import UNIT_ROWS


def test_a_small_chunk_is_spread_over_the_prep_processes() -> None:
    units = plan_units(np.arange(20), 16)
    assert [len(u) for u in units] == [2] * 10
    assert np.concatenate(units).tolist() == list(range(20))


def test_with_the_cache_off_a_chunk_goes_in_whole_units() -> None:
    units = plan_prepare(np.arange(512), {}, 16)
    assert [len(u) for u in units] == [UNIT_ROWS] * 16


def test_with_the_cache_on_each_process_prepares_its_rows_in_whole_units() -> None:
    """512 rows read by 16 processes, 32 each: 16 prepare units, not 256 units of 2."""
    rows = np.arange(512)
    read = [rows[i : i + UNIT_ROWS] for i in range(0, 512, UNIT_ROWS)]  # as `read_all` sends
    holder = {int(row): worker for worker, unit in enumerate(read) for row in unit}
    units = plan_prepare(rows, holder, 16)
    assert len(units) == 16
    for unit in units:  # each unit goes back to one process, the one holding its bytes
        assert len({holder[int(r)] for r in unit}) == 1
    assert sorted(np.concatenate(units).tolist()) == rows.tolist()


def test_the_misses_of_one_process_stay_together() -> None:
    """After the cache answered some rows, a process's misses are one unit, capped at 32."""
    holder = {row: row % 2 for row in range(100)}
    misses = np.asarray([r for r in range(100) if r % 5])  # 80 rows, 40 per process
    units = plan_prepare(misses, holder, 16)
    assert sorted(len(u) for u in units) == [8, 8, 32, 32]
    assert all(len({holder[int(r)] for r in u}) == 1 for u in units)
