"""What the GPU-decode path's prep costs per row, on the CPU: a `PrepPool` running `HeaderPrep`
over generated 640×480 JPEGs in units of 32 with byte slots, as a chunk sends them.

    python -m bench.prep_cost [rows] [processes]

Prints the prep processes' CPU µs per row (/proc), the engine-side prep thread's (the I/O
thread: writes what a full pipe left, reads every answer) and the caller's (submitting units,
the files' views). Figures are CPU time, so a busy machine inflates them less than wall time.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from bench.inputs import make_images
from kiln.app.core.config import get_settings
from kiln.workers.prep.pool import PrepPool
from kiln.workers.prep.slots import ByteSlots
from kiln.workers.prep.spec import prep_spec
from kiln.workers.prep.units import UNIT_ROWS, Prepped, Unit, in_place

TICK = os.sysconf("SC_CLK_TCK")
SPEC = prep_spec(
    "kiln.workers.prep.images:HeaderPrep", {"max_pixels": 50_000_000}, meta_width=4,
    byte_slots=True,
)  # fmt: skip


def _cpu(stat: str) -> float:
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def measure(rows: int, processes: int, folder: Path) -> dict[str, float]:
    paths = make_images(folder / "images", 512, (640, 480))
    settings = get_settings(data_dir=folder / "data", local_inputs=True)
    pool, slots = PrepPool(settings, processes), ByteSlots(1024, label="bench")
    try:
        _run(pool, slots, paths, 256)  # every process started and its prep built
        pids = pool.pids()
        tids = [t.native_id for t in threading.enumerate() if t.name.startswith("kiln-prep")]
        prep = sum(_cpu(f"/proc/{p}/stat") for p in pids)
        io = sum(_cpu(f"/proc/self/task/{t}/stat") for t in tids)
        caller, wall = time.thread_time(), time.perf_counter()
        _run(pool, slots, paths, rows)
        wall = time.perf_counter() - wall
        caller = time.thread_time() - caller
        prep = sum(_cpu(f"/proc/{p}/stat") for p in pids) - prep
        io = sum(_cpu(f"/proc/self/task/{t}/stat") for t in tids) - io
    finally:
        pool.close()
        slots.close()
    per_row = 1e6 / rows
    return {
        "prep_us": prep * per_row, "io_us": io * per_row, "caller_us": caller * per_row,
        "threads": len(tids), "rows_s": rows / wall,
    }  # fmt: skip


def _run(pool: PrepPool, slots: ByteSlots, paths: list[Path], rows: int) -> None:
    """`rows` files in units of 32, two units per process in flight, each answer's files read
    through their views and the slots given back."""
    sent: deque[tuple[Future[Prepped], np.ndarray]] = deque()
    for start in range(0, rows, UNIT_ROWS):
        chosen = [paths[(start + i) % len(paths)] for i in range(UNIT_ROWS)]
        unit = Unit(0, SPEC, list(range(start, start + UNIT_ROWS)), [p.as_uri() for p in chosen],
                    [None] * UNIT_ROWS, 1 << 26)  # fmt: skip
        tickets = slots.acquire(UNIT_ROWS)
        assert tickets is not None
        unit.slots, unit.segment, unit.segment_slots = tickets, slots.name, slots.count
        unit.slot_bytes = slots.size
        sent.append((pool.submit(unit), tickets))
        while len(sent) >= 2 * pool.processes:
            _take(slots, *sent.popleft())
    while sent:
        _take(slots, *sent.popleft())


def _take(slots: ByteSlots, future: Future[Prepped], tickets: np.ndarray) -> None:
    answer = future.result(60)
    assert not any(answer.errors), answer.errors
    files = in_place(answer.objects or [], slots, tickets)
    assert all(len(data) > 1000 for data, _header in files)
    del files  # the views go before their slots are lent again
    slots.release(tickets)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with tempfile.TemporaryDirectory() as folder:
        got = measure(rows, processes, Path(folder))
    print(
        f"{rows} rows, {processes} prep processes, {got['threads']:.0f} prep thread(s) here: "
        f"prep {got['prep_us']:.0f} µs/row, I/O thread {got['io_us']:.1f} µs/row, "
        f"caller {got['caller_us']:.1f} µs/row, {got['rows_s']:.0f} rows/s"
    )


if __name__ == "__main__":
    main()
