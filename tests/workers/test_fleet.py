"""`kiln worker --devices all`: one pinned, named process per GPU, restarted when it dies."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from kiln.workers import fleet
from kiln.workers.device import Gpu
from kiln.workers.fleet import Fleet, child_args

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
