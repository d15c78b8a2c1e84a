"""CPU seconds and peak RSS of process trees, and latency percentiles.

CPU of a tree = each live process's own time plus the time of children it has already reaped,
so short-lived descendants (Postgres backends, Ray workers) are counted once, when they end.
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


def _tree(pids: Iterable[int]) -> list[tuple[psutil.Process, bool]]:
    """(process, whether its reaped children count) for the trees, or solos, `pids` name."""
    procs: dict[int, tuple[psutil.Process, bool]] = {}
    family = True
    for pid in pids:
        if pid == SOLO:
            family = False
            continue
        try:
            root = psutil.Process(pid)
            for proc in [root, *(root.children(recursive=True) if family else [])]:
                procs[proc.pid] = (proc, family)
        except psutil.NoSuchProcess:
            continue
    return list(procs.values())


def tree_cpu(pids: Iterable[int]) -> float:
    total = 0.0
    for proc, family in _tree(pids):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        total += t.user + t.system
        if family:
            total += t.children_user + t.children_system
    return total


def tree_rss(pids: Iterable[int]) -> int:
    total = 0
    for proc, _family in _tree(pids):
        try:
            total += proc.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return total


def service_pids() -> list[int]:
    """The Postgres postmaster(s) and Redis server on this machine (their CPU is shared cost)."""
    pids = []
    for proc in psutil.process_iter(["name", "ppid"]):
        name = proc.info["name"] or ""
        if name.startswith("redis-server"):
            pids.append(proc.pid)
        elif name in ("postgres", "postmaster"):
            try:
                parent = proc.parent()
            except psutil.NoSuchProcess:
                continue
            if parent is None or parent.name() not in ("postgres", "postmaster"):
                pids.append(proc.pid)
    return pids


@dataclass
class Usage:
    seconds: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


class Meter:
    """Measure named groups of process trees over a window, sampling RSS in a thread."""

    def __init__(self, groups: dict[str, Sequence[int]], interval: float = 0.2) -> None:
        self.groups = {name: list(pids) for name, pids in groups.items()}
        self.interval = interval
        self.usage = Usage()
        self._stop = threading.Event()
        self._peaks = dict.fromkeys(self.groups, 0)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample_once()

    def _sample_once(self) -> None:
        for name, pids in self.groups.items():
            self._peaks[name] = max(self._peaks[name], tree_rss(pids))

    @contextmanager
    def window(self) -> Iterator[Usage]:
        before = {name: tree_cpu(pids) for name, pids in self.groups.items()}
        sampler = threading.Thread(target=self._sample, name="bench-meter", daemon=True)
        sampler.start()
        started = time.perf_counter()
        try:
            yield self.usage
        finally:
            self.usage.seconds = time.perf_counter() - started
            self._stop.set()
            sampler.join()
            self._sample_once()
            self.usage.cpu_seconds = {
                name: round(tree_cpu(pids) - before[name], 3) for name, pids in self.groups.items()
            }
            self.usage.peak_rss_mb = {
                name: round(peak / 2**20, 1) for name, peak in self._peaks.items()
            }


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    if not samples_ms:
        return {}
    values = np.asarray(samples_ms, dtype=np.float64)
    return {f"p{q}": round(float(np.percentile(values, q)), 1) for q in (50, 90, 99)} | {
        "max": round(float(values.max()), 1)
    }
