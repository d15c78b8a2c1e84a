"""Whether a worker process is still doing its work, for its liveness probe.

Parts of the worker report problems they cannot recover from in-process — a batch stuck in
the engine past its deadline, a chunk run past its longest lease — and clear them if the
work comes back. A worker with a problem is unhealthy: its heartbeat file stops being touched
(`workers/ops/liveness.py`) and the orchestrator restarts it. Its stuck items are not lost: their
leases run out and the reconciler sends them again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineHealth:
    """What the worker's metrics say about its engines beyond batching."""

    problems: list[str] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)  # loaded model → bytes
    slot_memory: dict[str, int] = field(default_factory=dict)  # loaded model → its slots' bytes
    budget: int | None = None  # None until the first model loads
    unloaded: int = 0  # models unloaded to stay within the budget
    idle_unloaded: int = 0  # models unloaded, unused for KILN_MODEL_IDLE_S
    build_failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (model, backend)
    prep_processes: int = 0  # running (0 until the first chunk, or prep on the chunk's thread)
    prep_replaced: int = 0  # prep processes that died and were replaced
    rss_bytes: int | None = None  # this process's resident memory (None: not known here)
    prep_rss_bytes: int | None = None  # its prep processes', summed (None: none running)


class Health:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._problems: dict[str, str] = {}

    def fail(self, key: str, sentence: str) -> None:
        with self._lock:
            self._problems[key] = sentence

    def clear(self, key: str) -> None:
        with self._lock:
            self._problems.pop(key, None)

    def problems(self) -> list[str]:
        with self._lock:
            return list(self._problems.values())

    @property
    def healthy(self) -> bool:
        return not self.problems()
