"""The liveness file: touched while healthy, left to age while a problem stands."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kiln.workers.ops.health import Health
from kiln.workers.ops.liveness import Heartbeat


def test_the_file_ages_while_the_worker_is_unhealthy(tmp_path: Path) -> None:
    path = tmp_path / "live"
    health = Health()
    with Heartbeat(path, health.problems, interval_s=0.05):
        assert path.exists()
        os.utime(path, (0, 0))
        time.sleep(0.2)
        assert path.stat().st_mtime > time.time() - 5  # touched again
        health.fail("batch:ocr", "batcher-ocr: a batch has run for more than 300 s")
        time.sleep(0.1)  # a beat in flight may still land
        os.utime(path, (0, 0))
        time.sleep(0.2)
        assert path.stat().st_mtime == 0  # not touched while unhealthy
        health.clear("batch:ocr")
        time.sleep(0.2)
        assert path.stat().st_mtime > time.time() - 5


def test_a_beat_says_whether_it_touched(tmp_path: Path) -> None:
    health = Health()
    beat = Heartbeat(tmp_path / "sub" / "live", health.problems)
    assert beat.beat() is True
    health.fail("run:x", "a chunk run has held its items too long")
    assert beat.beat() is False
    assert not health.healthy
