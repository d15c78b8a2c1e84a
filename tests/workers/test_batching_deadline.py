"""The Batcher on a long-lived fleet: a stuck batch past its deadline, and a batch cap lowered
by an out-of-memory batch that grows back after a quiet period."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from kiln.workers.batching import BatchDeadlineError, Batcher, BatchPolicy, ListShape, Part

Block = list[int]


def rows_of(parts: Sequence[Part[Block]]) -> list[int]:
    return [row for part in parts for row in part.block[part.start : part.stop]]


def test_a_stuck_batch_fails_its_block_and_a_fresh_runner_serves_the_rest() -> None:
    release = threading.Event()
    events: list[str | None] = []

    def engine(parts: Sequence[Part[Block]]) -> list[int]:
        rows = rows_of(parts)
        if 13 in rows:
            release.wait(30)  # a wedged engine call
        return [r * 2 for r in rows]

    batcher: Batcher[Block, list[Any]] = Batcher(
        engine,
        ListShape(),
        BatchPolicy(max_batch=1, max_delay_s=0, deadline_s=0.2),
        on_wedged=events.append,
    )
    try:
        stuck = batcher.submit([13, 1, 2])  # its first row wedges the engine: the block fails
        with pytest.raises(BatchDeadlineError, match=r"has run for more than 0\.2 s"):
            stuck.result(timeout=5)
        assert batcher.submit([4]).result(timeout=5) == [8]  # the replacement runner
        assert len(events) == 1 and "engine looks stuck" in (events[0] or "")
        assert batcher.snapshot().expired_batches == 1
        release.set()  # the stuck call returns: its result is dropped, the worker recovers
        deadline = time.monotonic() + 5
        while events[-1] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[-1] is None
        assert isinstance(stuck.exception(), BatchDeadlineError)
        assert batcher.submit([5]).result(timeout=5) == [10]
    finally:
        release.set()
        batcher.close()


def test_the_watchdog_fails_every_block_of_the_stuck_batch() -> None:
    """Two callers' blocks share the batch that wedges: both futures fail with the deadline
    error; a block queued behind them is served by the fresh runner."""
    release = threading.Event()

    def engine(parts: Sequence[Part[Block]]) -> list[int]:
        rows = rows_of(parts)
        if 13 in rows:
            release.wait(30)
        return [r * 2 for r in rows]

    batcher: Batcher[Block, list[Any]] = Batcher(
        engine, ListShape(), BatchPolicy(max_batch=3, max_delay_s=5.0, deadline_s=0.2)
    )
    try:
        first, second = batcher.submit([13]), batcher.submit([1, 2])  # one full batch of 3
        for future in (first, second):
            with pytest.raises(BatchDeadlineError, match="engine looks stuck"):
                future.result(timeout=5)
        assert batcher.submit([3, 4, 5]).result(timeout=5) == [6, 8, 10]
        assert batcher.snapshot().expired_batches == 1
    finally:
        release.set()
        batcher.close()


def test_no_deadline_no_watchdog() -> None:
    batcher: Batcher[Block, list[Any]] = Batcher(
        rows_of, ListShape(), BatchPolicy(max_batch=2, max_delay_s=0), name="solo"
    )
    try:
        assert batcher.submit([1]).result(timeout=5) == [1]
        assert "solo-runner-0" in {t.name for t in threading.enumerate()}
        assert "solo-watchdog" not in {t.name for t in threading.enumerate()}
    finally:
        batcher.close()


def test_an_out_of_memory_cap_grows_back_after_a_quiet_period() -> None:
    fits = {"rows": 2}

    def engine(parts: Sequence[Part[Block]]) -> list[int]:
        rows = rows_of(parts)
        if len(rows) > fits["rows"]:
            raise MemoryError("out of memory")
        return rows

    batcher: Batcher[Block, list[Any]] = Batcher(
        engine, ListShape(), BatchPolicy(max_batch=8, max_delay_s=0.05, oom_recovery_s=0.3)
    )
    try:
        assert batcher.submit(list(range(8))).result(timeout=5) == list(range(8))
        assert batcher.max_batch <= 2 and batcher.policy.max_batch == 8
        fits["rows"] = 8  # the neighbour that held the memory is gone
        time.sleep(0.35)
        batcher.submit([1]).result(timeout=5)
        assert batcher.max_batch == 4  # one doubling per quiet period
        time.sleep(0.35)
        batcher.submit([1]).result(timeout=5)
        assert batcher.max_batch == 8
        time.sleep(0.35)
        batcher.submit([1]).result(timeout=5)
        assert batcher.max_batch == 8  # never past the configured cap
    finally:
        batcher.close()
