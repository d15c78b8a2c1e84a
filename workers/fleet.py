"""`kiln worker --devices all`: one worker process per visible GPU, supervised.

Each child is a fresh interpreter pinned to its device before anything touches CUDA (never a
fork after CUDA is initialised). A child that dies is restarted with backoff; SIGTERM and
SIGINT are passed on, so the children finish the batch in hand.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

from kiln.workers.device import Gpu

log = logging.getLogger(__name__)

RESTART_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def child_args(gpu: Gpu, host: str, extra: list[str], metrics_port: int | None) -> list[str]:
    """The command line of the worker for `gpu`: pinned, named `gpu<N>@<host>`."""
    args = [sys.executable, "-m", "kiln.app.cli", "worker", "--device", str(gpu.index)]
    args += ["--hostname", f"gpu{gpu.index}@{host}"]
    if metrics_port:
        args += ["--metrics-port", str(metrics_port + gpu.index)]  # one port per device
    return args + extra


@dataclass
class _Child:
    args: list[str]
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)


class Fleet:
    def __init__(self, commands: list[list[str]]) -> None:
        self.children = [_Child(c, subprocess.Popen(c)) for c in commands]
        self.stopping = False

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        self.stopping = True
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signum)

    def run(self) -> int:
        """Supervise until stopped; the worst exit code of the children."""
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            for signum in (signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, self.stop)
        while not self.stopping:
            for child in self.children:
                if child.proc.poll() is not None and not self.stopping:
                    self._restart(child)
            time.sleep(0.5)
        return max((c.proc.wait() for c in self.children), default=0)

    def _restart(self, child: _Child) -> None:
        if time.monotonic() - child.started > 300:
            child.restarts = 0  # it ran a good while: start the backoff afresh
        delay = RESTART_DELAYS_S[min(child.restarts, len(RESTART_DELAYS_S) - 1)]
        log.warning("worker %s exited with %s; restarting in %.0f s",
                    child.args[-1], child.proc.returncode, delay)  # fmt: skip
        time.sleep(delay)
        child.proc = subprocess.Popen(child.args)
        child.restarts += 1
        child.started = time.monotonic()
