"""Failed builds, remembered per model version and backend, so a build that cannot succeed is
not tried again on every chunk: after a failure the pair waits `base_s`, doubling per further
failure up to a day; a success forgets it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_WAIT_S = 24 * 3600.0


@dataclass(frozen=True)
class Failure:
    reason: str
    attempts: int
    retry_at: float  # on the failures' clock


class BuildFailures:
    def __init__(self, base_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s = base_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failed: dict[tuple[str, str], Failure] = {}

    def record(self, model: str, backend: str, reason: str) -> Failure:
        with self._lock:
            previous = self._failed.get((model, backend))
            attempts = previous.attempts + 1 if previous else 1
            wait = min(MAX_WAIT_S, self.base_s * 2 ** (attempts - 1))
            failure = Failure(reason, attempts, self._clock() + wait)
            self._failed[(model, backend)] = failure
            return failure

    def forget(self, model: str, backend: str) -> None:
        with self._lock:
            self._failed.pop((model, backend), None)

    def waiting(self, model: str, backend: str) -> Failure | None:
        """The failure that still holds the pair back, if any."""
        with self._lock:
            failure = self._failed.get((model, backend))
        return failure if failure is not None and failure.retry_at > self._clock() else None

    def seconds_left(self, failure: Failure) -> float:
        return max(0.0, failure.retry_at - self._clock())

    def snapshot(self) -> dict[tuple[str, str], Failure]:
        with self._lock:
            return dict(self._failed)
