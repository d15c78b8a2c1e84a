"""CPU seconds and peak RSS of process trees, and latency percentiles.

A sampler thread walks each tree every `interval` seconds and remembers every process it has
seen with its own CPU time, so a process that ends inside the window (an actor Ray stops, a
Postgres backend) still counts up to its last sample. Children's times are not added: a parent
that reaps a child would count it twice, and some (Ray's raylet) reap without recording any.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import psutil

SOLO = -1  # in a group's pid list: the pids after it count alone, without descendants

ProcKey = tuple[int, float]  # pid and start time: a reused pid is another process


def _tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes of the trees (or, after `SOLO`, the single processes) `pids` name."""
    procs: dict[int, psutil.Process] = {}
    family = True
    for pid in pids:
        if pid == SOLO:
            family = False
            continue
        try:
            root = psutil.Process(pid)
            for proc in [root, *(root.children(recursive=True) if family else [])]:
                procs[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    return list(procs.values())


def _own_cpu(proc: psutil.Process) -> tuple[ProcKey, float, int] | None:
    try:
        with proc.oneshot():
            times = proc.cpu_times()
            return (proc.pid, proc.create_time()), times.user + times.system, proc.memory_info().rss
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


class _Group:
    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.baseline: dict[ProcKey, float] = {}
        self.last: dict[ProcKey, float] = {}
        self.peak_rss = 0

    def sample(self, first: bool = False) -> None:
        rss = 0
        for proc in _tree(self.pids):
            seen = _own_cpu(proc)
            if seen is None:
                continue
            key, cpu, proc_rss = seen
            # Alive at the start: count from there; born later: count its whole life.
            self.baseline.setdefault(key, cpu if first else 0.0)
            self.last[key] = cpu
            rss += proc_rss
        self.peak_rss = max(self.peak_rss, rss)

    @property
    def cpu_seconds(self) -> float:
        return sum(self.last[key] - base for key, base in self.baseline.items())


def service_pids() -> list[int]:
    """The Postgres postmaster(s) and Redis server on this machine (their CPU is shared cost)."""
    groups = service_groups()
    return [*groups["postgres"], *groups["redis"]]


def service_groups() -> dict[str, list[int]]:
    """The Postgres postmaster(s) and the Redis server(s), apart."""
    groups: dict[str, list[int]] = {"postgres": [], "redis": []}
    for proc in psutil.process_iter(["name", "ppid"]):
        name = proc.info["name"] or ""
        if name.startswith("redis-server"):
            groups["redis"].append(proc.pid)
        elif name in ("postgres", "postmaster"):
            try:
                parent = proc.parent()
            except psutil.NoSuchProcess:
                continue
            if parent is None or parent.name() not in ("postgres", "postmaster"):
                groups["postgres"].append(proc.pid)
    return groups


@dataclass
class Usage:
    seconds: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


class Meter:
    """Measure named groups of process trees over a window."""

    def __init__(self, groups: dict[str, Sequence[int]], interval: float = 0.2) -> None:
        self.groups = {name: _Group(pids) for name, pids in groups.items()}
        self.interval = interval
        self.usage = Usage()
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            for group in self.groups.values():
                group.sample()

    @contextmanager
    def window(self) -> Iterator[Usage]:
        for group in self.groups.values():
            group.sample(first=True)
        sampler = threading.Thread(target=self._sample, name="bench-meter", daemon=True)
        sampler.start()
        started = time.perf_counter()
        try:
            yield self.usage
        finally:
            self.usage.seconds = time.perf_counter() - started
            self._stop.set()
            sampler.join()
            for group in self.groups.values():
                group.sample()
            self.usage.cpu_seconds = {n: round(g.cpu_seconds, 3) for n, g in self.groups.items()}
            self.usage.peak_rss_mb = {
                n: round(g.peak_rss / 2**20, 1) for n, g in self.groups.items()
            }


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    if not samples_ms:
        return {}
    values = np.asarray(samples_ms, dtype=np.float64)
    return {f"p{q}": round(float(np.percentile(values, q)), 1) for q in (50, 90, 99)} | {
        "max": round(float(values.max()), 1)
    }
