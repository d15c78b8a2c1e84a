"""Worker liveness for probes: a file touched every few seconds while the worker is healthy.

`kiln worker --live-file PATH` starts a thread that touches PATH every `interval_s` while the
worker reports no problem (`workers/ops/health.py`). A wedged engine or a run stuck past its
longest lease stops the touching, so a probe on the file's age fails and the orchestrator
restarts the worker (deploy/base/worker-gpu.yaml: `livenessProbe`). No port, no HTTP, and the
probe never imports Python.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class Heartbeat:
    """Touches `path` every `interval_s` while `problems()` is empty; a context manager."""

    def __init__(
        self, path: Path, problems: Callable[[], list[str]], interval_s: float = 5.0
    ) -> None:
        self.path = path
        self.problems = problems
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness", daemon=True)
        self._reported: list[str] = []

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def beat(self) -> bool:
        """Touch the file if healthy; returns whether it did."""
        problems = self.problems()
        if problems:
            if problems != self._reported:  # say it once, not every beat
                log.error("worker unhealthy, liveness file left to age: %s", "; ".join(problems))
            self._reported = problems
            return False
        self._reported = []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError as error:  # a full or read-only disk: the probe will say so
                log.warning("could not touch liveness file %s: %s", self.path, error)
