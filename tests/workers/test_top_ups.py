"""The process's fair-share top-up thread (workers/ops/top_ups.py): a request returns at once,
the top-up runs on its own thread, and requests made while one runs fold into one more run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kiln.app.dispatch.contract import Dispatcher
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.workers.ops.top_ups import TopUps


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_request_returns_at_once_and_the_top_up_runs_on_its_own_thread() -> None:
    release, seen = threading.Event(), []

    def top_up(dispatcher: Dispatcher) -> None:
        seen.append((dispatcher, threading.current_thread().name))
        release.wait(5)

    top_ups = TopUps(top_up)
    dispatcher = RecordingDispatcher()
    started = time.monotonic()
    top_ups.request(dispatcher)
    assert time.monotonic() - started < 0.5  # the chunk's thread does not wait
    wait_for(lambda: len(seen) == 1)
    assert seen[0] == (dispatcher, "fair-share")
    release.set()
    wait_for(lambda: top_ups.runs == 1)


def test_requests_during_a_run_fold_into_one_more() -> None:
    release, calls = threading.Event(), []

    def top_up(dispatcher: Dispatcher) -> None:
        calls.append(dispatcher)
        release.wait(5)

    top_ups = TopUps(top_up)
    top_ups.request(RecordingDispatcher())
    wait_for(lambda: len(calls) == 1)
    for _ in range(10):  # a burst of chunks ending while the first top-up runs
        top_ups.request(RecordingDispatcher())
    release.set()
    wait_for(lambda: top_ups.runs == 2)
    time.sleep(0.1)
    assert top_ups.runs == 2 and len(calls) == 2
