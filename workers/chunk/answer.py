"""Run some of a chunk's rows through one model: the rows planned into units, read first when
the content cache is on, then pumped through prep → batch → engine (`pump.Pump`).

With the content cache on, units first only *read* their items (fetch and hash, bytes kept in
the prep process); one lookup answers what the cache knows, and only the rest is decoded.
"""

from __future__ import annotations

import math
from concurrent.futures import Future

import numpy as np

from kiln.workers.chunk.pump import ModelPass, Pump, make_unit, record_prep
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.prep.units import UNIT_ROWS, Prepped, Unit


def plan_units(rows: np.ndarray, processes: int, most: int | None = None) -> list[np.ndarray]:
    """Rows in units of at most `most` (UNIT_ROWS), about one per prep process for a small
    chunk."""
    if not len(rows):
        return []
    size = max(1, min(most or UNIT_ROWS, math.ceil(len(rows) / max(1, processes))))
    return [rows[i : i + size] for i in range(0, len(rows), size)]


# --- reading first (content cache on) ----------------------------------------------------


def read_all(model_pass: ModelPass, rows: ChunkRows, indices: np.ndarray) -> dict[int, int]:
    """Fetch and hash every row (its bytes stay in the prep process that read them); returns
    row → that process, for the prepare units to go back to it. A unit not sent before the
    lease says stop is not started: its rows are cancelled."""
    units = plan_units(indices, model_pass.prep.processes)
    sent: list[tuple[np.ndarray, Future[Prepped]]] = []
    for unit in units:
        if model_pass.held.stopping():
            rows.cancelled[unit] = True
            continue
        sent.append(
            (unit, model_pass.prep.submit(make_unit(model_pass, rows, unit, read_only=True)))
        )
    holder: dict[int, int] = {}
    for unit, future in sent:
        prepped = future.result()
        record_prep(rows, unit, prepped)
        holder |= dict.fromkeys(unit.tolist(), prepped.worker)
    return holder


def run_model(
    model_pass: ModelPass, rows: ChunkRows, indices: np.ndarray, holder: dict[int, int]
) -> None:
    """Prepare, batch and answer `indices` of the chunk with the pass's model."""
    units = plan_prepare(indices, holder, model_pass.prep.processes)
    with model_pass.runner.batcher.expect(
        sum(len(u) for u in units), model_pass.urgent
    ) as announced:
        Pump(model_pass, rows, units, announced).run(holder)


def plan_prepare(indices: np.ndarray, holder: dict[int, int], processes: int) -> list[np.ndarray]:
    """The units that prepare `indices`. Rows already read (`holder`: row → the prep process
    keeping its bytes) are planned per process, so each unit goes back to the bytes it needs,
    in whole units of up to UNIT_ROWS: the read units were spread over the processes already,
    and cutting each process's rows again into `processes` pieces only multiplies the round
    trips, chunk-thread events and Batcher blocks (16 processes made a 512-row chunk 256 units
    of 2)."""
    if not holder:
        return plan_units(indices, processes)
    by_worker: dict[int, list[int]] = {}
    for row in indices.tolist():
        by_worker.setdefault(holder.get(row, -1), []).append(row)
    return [unit for group in by_worker.values() for unit in plan_units(np.asarray(group), 1)]


def drop_held(
    model_pass: ModelPass, rows: ChunkRows, done: list[int], holder: dict[int, int]
) -> None:
    """Rows read for nothing more (the cache answered them): their prep processes may let
    their bytes go now rather than when newer ones push them out."""
    by_worker: dict[int, list[int]] = {}
    for row in done:
        by_worker.setdefault(holder.get(row, -1), []).append(rows.items[row].id)
    for worker, items in by_worker.items():
        unit = Unit(
            0, model_pass.runner.predictor.prep, [], [], [], model_pass.max_bytes, drop=items
        )
        model_pass.prep.submit(unit, worker)  # nothing to wait for
