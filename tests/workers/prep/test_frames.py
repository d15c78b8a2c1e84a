"""Frame affinity: which prep process a chunk's run of video frames goes to, and when a run
waits for one with room."""

from __future__ import annotations

import threading
import time

from kiln.workers.prep.frames import ANY, FRAME_RUNS, FrameScheduler


def test_a_run_goes_to_the_process_decoding_fewest_runs_then_holding_fewest_units() -> None:
    loads = {1: 3, 2: 0, 3: 1}
    frames = FrameScheduler(lambda: loads)
    assert frames.claim() == 2
    assert frames.claim() == 3  # 2 decodes a run now
    assert frames.claim() == 1


def test_a_run_waits_while_every_process_decodes_as_many_runs_as_it_keeps_readers_for() -> None:
    frames = FrameScheduler(lambda: {1: 0})
    assert [frames.claim() for _ in range(FRAME_RUNS)] == [1] * FRAME_RUNS
    started = time.monotonic()
    assert frames.claim(timeout=0.1) is None
    assert time.monotonic() - started >= 0.1


def test_a_run_ending_wakes_a_waiting_claim() -> None:
    frames = FrameScheduler(lambda: {1: 0})
    for _ in range(FRAME_RUNS):
        frames.claim()
    threading.Timer(0.05, frames.release, (1,)).start()
    assert frames.claim(timeout=10) == 1


def test_a_closing_pool_gives_up_a_waiting_claim() -> None:
    frames = FrameScheduler(lambda: {1: 0})
    for _ in range(FRAME_RUNS):
        frames.claim()
    threading.Timer(0.05, frames.close).start()
    started = time.monotonic()
    assert frames.claim(timeout=10) is None
    assert time.monotonic() - started < 5


def test_a_replaced_process_is_not_claimed_and_its_runs_do_not_count_on_its_successor() -> None:
    loads = {1: 0, 2: 0}
    frames = FrameScheduler(lambda: loads)
    assert frames.claim() == 1
    del loads[1]
    loads[3] = 0  # 1 died; 3 replaced it
    assert frames.claim() == 2
    assert frames.claim() == 3
    frames.release(1)  # the run on the dead process ends: nothing to wake, nothing breaks


def test_without_processes_frames_go_anywhere() -> None:
    frames = FrameScheduler(dict)
    assert frames.claim() == ANY
    frames.release(ANY)
