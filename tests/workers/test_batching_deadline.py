"""The Batcher on a long-lived fleet: a stuck batch past its deadline, and a batch cap lowered
by an out-of-memory batch that grows back after a quiet period."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from kiln.workers.batching import BatchDeadlineError, Batcher


def test_a_stuck_batch_fails_its_rows_and_a_fresh_runner_serves_the_rest() -> None:
    release = threading.Event()
    events: list[str | None] = []

    def engine(rows: Sequence[int]) -> list[int]:
        if 13 in rows:
            release.wait(30)  # a wedged engine call
        return [r * 2 for r in rows]

    batcher = Batcher(engine, max_batch=1, max_delay_s=0, deadline_s=0.2, on_wedged=events.append)
    try:
        stuck = batcher.submit(13)
        with pytest.raises(BatchDeadlineError, match=r"has run for more than 0\.2 s"):
            stuck.result(timeout=5)
        assert batcher.submit(4).result(timeout=5) == 8  # the replacement runner
        assert len(events) == 1 and "engine looks stuck" in (events[0] or "")
        assert batcher.snapshot().expired_batches == 1
        release.set()  # the stuck call returns: its result is dropped, the worker recovers
        deadline = time.monotonic() + 5
        while events[-1] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[-1] is None
        assert isinstance(stuck.exception(), BatchDeadlineError)
        assert batcher.submit(5).result(timeout=5) == 10
    finally:
        release.set()
        batcher.close()


def test_no_deadline_no_watchdog() -> None:
    batcher = Batcher(lambda rows: list(rows), max_batch=2, max_delay_s=0, name="solo")
    try:
        assert batcher.submit(1).result(timeout=5) == 1
        assert "solo-runner-0" in {t.name for t in threading.enumerate()}
        assert "solo-watchdog" not in {t.name for t in threading.enumerate()}
    finally:
        batcher.close()


def test_an_out_of_memory_cap_grows_back_after_a_quiet_period() -> None:
    fits = {"rows": 2}

    def engine(rows: Sequence[int]) -> list[int]:
        if len(rows) > fits["rows"]:
            raise MemoryError("out of memory")
        return list(rows)

    batcher = Batcher(engine, max_batch=8, max_delay_s=0.05, oom_recovery_s=0.3)
    try:
        assert [f.result(timeout=5) for f in batcher.submit_many(list(range(8)))] == list(range(8))
        assert batcher.max_batch <= 2 and batcher.cap == 8
        fits["rows"] = 8  # the neighbour that held the memory is gone
        time.sleep(0.35)
        batcher.submit(1).result(timeout=5)
        assert batcher.max_batch == 4  # one doubling per quiet period
        time.sleep(0.35)
        batcher.submit(1).result(timeout=5)
        assert batcher.max_batch == 8
        time.sleep(0.35)
        batcher.submit(1).result(timeout=5)
        assert batcher.max_batch == 8  # never past the configured cap
    finally:
        batcher.close()
