"""A worker's device-memory budget: which loaded models stay, and which idle ones go.

A long-lived multi-tenant worker sees many `name:version`s; each loaded engine keeps its
weights and buffers sized for its largest batch. The budget bounds what stays loaded: before a
model is built, idle models are unloaded least-recently-used first until its estimate fits;
a model in use (a chunk holds it, or its Batcher has rows) is never unloaded. Sizes are the
engines' own accounts (`engine_bytes`), so the logic runs on CPU with sizes a test declares.

Time bounds them too, on any device: a model no chunk has used for `KILN_MODEL_IDLE_S` is
unloaded (`ModelMemory.idle`), so a CPU worker — whose budget, host memory, is rarely reached —
gives back what a model it no longer runs held. `rss_bytes` says what a process holds in all.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.app.core.errors import TransientError
from kiln.workers.engines.base import MemoryAccount

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class MemoryBudgetFullError(TransientError):
    """The model does not fit beside the models in use; the chunk retries later."""


def budget_bytes(setting: str, device_bytes: int) -> int:
    """`0.8` → that fraction of the device; `24GiB` or `12000000` → that many bytes."""
    size = _SIZE.match(setting)
    if size and (size.group(2) or float(setting) > 1):
        return int(size.group(1)) * _UNITS[size.group(2) or "B"]
    return int(float(setting) * device_bytes)


def host_memory_bytes() -> int:
    """Physical memory: the CPU engines' device."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rss_bytes(pid: int | None = None) -> int | None:
    """A process's resident memory (this one's without `pid`), shared pages included (its
    models' slots, mapped by the prep processes too): Linux's `/proc/PID/statm`. None where
    that cannot be read (another OS, a process gone)."""
    try:
        resident = Path(f"/proc/{pid or 'self'}/statm").read_text().split()[1]
        return int(resident) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def trim_host_memory() -> None:
    """Hand the heap an unloaded model freed back to the system: glibc keeps freed memory in
    its arenas, where it still counts in the process's RSS. A no-op without glibc."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def engine_bytes(engine: object, onnx_path: Path | None = None) -> int:
    """What an engine holds: its own account (`MemoryAccount`) when it keeps one, else the ONNX
    file's size twice (weights, and the optimised copy a runtime makes of them)."""
    if isinstance(engine, MemoryAccount):
        return engine.memory_bytes
    return 2 * onnx_path.stat().st_size if onnx_path is not None and onnx_path.is_file() else 0


@dataclass
class _Loaded:
    bytes: int
    last_used: float
    users: int = 0


class ModelMemory:
    """The loaded models' sizes, last use and current users, under one lock."""

    def __init__(self, budget: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._clock = clock
        self._lock = threading.Lock()
        self._loaded: dict[str, _Loaded] = {}
        self.evictions = 0  # unloaded to stay within the budget
        self.idle_unloads = 0  # unloaded after `idle` chose them

    def used(self) -> int:
        with self._lock:
            return sum(m.bytes for m in self._loaded.values())

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {key: m.bytes for key, m in self._loaded.items()}

    def add(self, key: str, size: int) -> None:
        with self._lock:
            self._loaded[key] = _Loaded(size, self._clock())

    def unload(self, key: str, idle: bool = False) -> None:
        """The model left the device (counted in `evictions`, or `idle_unloads`)."""
        with self._lock:
            if self._loaded.pop(key, None) is not None:
                if idle:
                    self.idle_unloads += 1
                else:
                    self.evictions += 1

    def acquire(self, key: str) -> None:
        """A chunk starts using the model: it cannot be unloaded until `release`."""
        with self._lock:
            loaded = self._loaded.get(key)
            if loaded is not None:
                loaded.users += 1
                loaded.last_used = self._clock()

    def release(self, key: str) -> None:
        with self._lock:
            loaded = self._loaded.get(key)
            if loaded is not None:
                loaded.users = max(0, loaded.users - 1)
                loaded.last_used = self._clock()

    def in_use(self, key: str) -> bool:
        with self._lock:
            loaded = self._loaded.get(key)
            return loaded is not None and loaded.users > 0

    def victims(self, need: int, busy: Iterable[str] = ()) -> list[str]:
        """Idle models to unload, least recently used first, so `need` more bytes fit. Raises
        `MemoryBudgetFullError` when unloading every idle model would not be enough; nothing
        is asked when the model alone is larger than the budget and nothing else is loaded."""
        with self._lock:
            busy = set(busy) | {k for k, m in self._loaded.items() if m.users}
            free = self.budget - sum(m.bytes for m in self._loaded.values())
            chosen: list[str] = []
            idle = sorted((m.last_used, k) for k, m in self._loaded.items() if k not in busy)
            for _, key in idle:
                if free >= need:
                    break
                chosen.append(key)
                free += self._loaded[key].bytes
            if free < need and busy:
                raise MemoryBudgetFullError(
                    f"The model needs about {need / 2**20:.0f} MiB of device memory and the "
                    f"budget ({self.budget / 2**20:.0f} MiB) is held by models in use "
                    f"({', '.join(sorted(busy))}); the chunk will be retried."
                )
            return chosen

    def idle(self, idle_s: float) -> list[str]:
        """Models no chunk holds and none has used for `idle_s` seconds (since its last
        release, or its load), least recently used first; none when `idle_s` is 0."""
        if idle_s <= 0:
            return []
        with self._lock:
            now = self._clock()
            idle = sorted(
                (m.last_used, k)
                for k, m in self._loaded.items()
                if not m.users and now - m.last_used >= idle_s
            )
            return [key for _, key in idle]
