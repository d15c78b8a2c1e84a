"""`kiln worker --devices all`: one worker process per visible GPU, supervised.

Each child is a fresh interpreter pinned to its device before anything touches CUDA (never a
fork after CUDA is initialised). A child that dies is restarted with backoff; SIGTERM and
SIGINT are passed on, so the children finish the batch in hand. With `--live-file PATH` each
child touches `PATH.gpu<N>` while healthy (`workers/ops/liveness.py`), and a child whose file has
aged past `LIVE_MAX_AGE_S` — a stuck engine, a deadlocked run — is killed and restarted.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from kiln.workers.ops.device import Gpu

log = logging.getLogger(__name__)

RESTART_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 30.0)
LIVE_MAX_AGE_S = 60.0  # as the Kubernetes livenessProbe of a one-GPU worker


def prep_share(cores: int, gpus: int) -> int:
    """Prep processes per device's worker: the host's cores split between its GPUs."""
    return max(1, cores // max(1, gpus))


def live_path(live: Path, gpu: Gpu) -> Path:
    return live.with_name(f"{live.name}.gpu{gpu.index}")


def child_args(
    gpu: Gpu, host: str, extra: list[str], metrics_port: int | None, live: Path | None = None
) -> list[str]:
    """The command line of the worker for `gpu`: pinned, named `gpu<N>@<host>`."""
    args = [sys.executable, "-m", "kiln.app.cli", "worker", "--device", str(gpu.index)]
    args += ["--hostname", f"gpu{gpu.index}@{host}"]
    if metrics_port:
        args += ["--metrics-port", str(metrics_port + gpu.index)]  # one port per device
    if live is not None:
        args += ["--live-file", str(live_path(live, gpu))]
    return args + extra


@dataclass
class _Child:
    args: list[str]
    proc: subprocess.Popen[bytes]
    live: Path | None = None
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)

    def stale(self, max_age_s: float) -> bool:
        """Running, past its start-up, and its liveness file not touched for `max_age_s`."""
        if self.live is None or self.proc.poll() is not None:
            return False
        if time.monotonic() - self.started < max_age_s:
            return False  # a new child's first beat is still to come
        try:
            return time.time() - self.live.stat().st_mtime > max_age_s
        except FileNotFoundError:
            return True


class Fleet:
    def __init__(
        self,
        commands: list[list[str]],
        lives: list[Path | None] | None = None,
        live_max_age_s: float = LIVE_MAX_AGE_S,
    ) -> None:
        lives = lives or [None] * len(commands)
        for live in lives:
            if live is not None:
                live.unlink(missing_ok=True)  # a file left by an earlier run says nothing
        self.children = [
            _Child(c, subprocess.Popen(c), live) for c, live in zip(commands, lives, strict=True)
        ]
        self.live_max_age_s = live_max_age_s
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
                if child.stale(self.live_max_age_s) and not self.stopping:
                    log.error("worker %s is unhealthy (%s not touched for %.0f s); killing it",
                              child.args[-1], child.live, self.live_max_age_s)  # fmt: skip
                    child.proc.kill()  # a stuck engine call ignores a warm shutdown
                    child.proc.wait()
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
        if child.live is not None:
            child.live.unlink(missing_ok=True)
        child.proc = subprocess.Popen(child.args)
        child.restarts += 1
        child.started = time.monotonic()
