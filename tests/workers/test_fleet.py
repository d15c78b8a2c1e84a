"""`kiln worker --devices all`: one pinned, named process per GPU, restarted when it dies."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.workers.ops import fleet
from kiln.workers.ops.device import Gpu
from kiln.workers.ops.fleet import Fleet, child_args

GPU1 = Gpu(1, "NVIDIA L4", "GPU-b", (8, 9), 0)


def test_each_child_is_pinned_named_and_gets_its_own_metrics_port() -> None:
    args = child_args(GPU1, "box", ["--queues", "interactive"], 9800)
    assert args[1:] == [
        "-m", "kiln.app.cli", "worker", "--device", "1", "--hostname", "gpu1@box",
        "--metrics-port", "9801", "--queues", "interactive",
    ]  # fmt: skip
    assert "--metrics-port" not in child_args(GPU1, "box", [], None)


def test_a_dead_child_is_restarted_and_stop_is_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet, "RESTART_DELAYS_S", (0.01,))
    dying = [sys.executable, "-c", "raise SystemExit(3)"]
    sleeping = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = Fleet([dying, sleeping])
    runner = threading.Thread(target=supervisor.run)
    runner.start()
    deadline = time.monotonic() + 20
    while supervisor.children[0].restarts < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert supervisor.children[0].restarts >= 2
    supervisor.stop(signal.SIGTERM)
    runner.join(20)
    assert not runner.is_alive()
    assert supervisor.children[1].proc.returncode == -signal.SIGTERM  # it got the signal


def test_each_child_touches_its_own_liveness_file(tmp_path: Path) -> None:
    args = child_args(GPU1, "box", [], None, tmp_path / "live")
    assert args[-2:] == ["--live-file", str(tmp_path / "live.gpu1")]


def test_a_child_whose_liveness_file_ages_is_killed_and_restarted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A stuck engine keeps the process alive but stops its heartbeat: the supervisor ends it."""
    monkeypatch.setattr(fleet, "RESTART_DELAYS_S", (0.01,))
    healthy, stuck = tmp_path / "live.gpu0", tmp_path / "live.gpu1"
    beating = [sys.executable, "-c", BEAT.format(path=str(healthy))]
    silent = [sys.executable, "-c", "import time; time.sleep(60)"]  # never touches its file
    supervisor = Fleet([beating, silent], [healthy, stuck], live_max_age_s=0.5)
    runner = threading.Thread(target=supervisor.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while supervisor.children[1].restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.children[1].restarts >= 1
        assert supervisor.children[0].restarts == 0  # its heartbeat kept it
    finally:
        supervisor.stop(signal.SIGTERM)
        runner.join(20)


BEAT = "import pathlib, time\nwhile True:\n    pathlib.Path({path!r}).touch(); time.sleep(0.05)"
