"""The device-memory budget's arithmetic: sizes a test declares, no device."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.workers.runners.memory import (
    MemoryBudgetFullError,
    ModelMemory,
    budget_bytes,
    engine_bytes,
    rss_bytes,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1  # every event is later than the one before
        return self.now


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("0.8", 800),
        ("1", 1000),
        ("0.25", 250),
        ("4096", 4096),
        ("24GiB", 24 * 2**30),
        ("2 GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
    ],
)
def test_budget_is_a_fraction_of_the_device_or_a_size(setting: str, expected: int) -> None:
    assert budget_bytes(setting, 1000) == expected


def test_idle_models_go_least_recently_used_first() -> None:
    memory = ModelMemory(budget=300, clock=Clock())
    memory.add("a", 100)
    memory.add("b", 100)
    memory.add("c", 100)
    memory.acquire("a")  # a chunk uses a: now the most recently used, and busy
    memory.release("a")
    assert memory.victims(100) == ["b"]
    assert memory.victims(200) == ["b", "c"]
    assert memory.victims(0) == []


def test_a_model_in_use_is_never_unloaded() -> None:
    memory = ModelMemory(budget=300, clock=Clock())
    memory.add("a", 200)
    memory.add("b", 100)
    memory.acquire("a")
    assert memory.victims(100) == ["b"]
    with pytest.raises(MemoryBudgetFullError, match="held by models in use \\(a\\)"):
        memory.victims(250)
    memory.release("a")
    assert memory.victims(250) == ["b", "a"]  # a was used last


def test_a_model_larger_than_the_budget_loads_alone() -> None:
    memory = ModelMemory(budget=100)
    assert memory.victims(500) == []  # nothing to unload, nothing in use: let it try
    memory.add("big", 500)
    assert memory.victims(10) == ["big"]


def test_engine_bytes_prefers_the_engines_own_account(tmp_path: Path) -> None:
    class Counted:
        memory_bytes = 12345

    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x" * 1000)
    assert engine_bytes(Counted(), onnx) == 12345
    assert engine_bytes(object(), onnx) == 2000  # weights, and the runtime's copy of them
    assert engine_bytes(object(), tmp_path / "missing.onnx") == 0


class Still:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_model_unused_for_the_idle_time_is_idle_least_recently_used_first() -> None:
    clock = Still()
    memory = ModelMemory(budget=300, clock=clock)
    memory.add("a", 100)  # loaded at 0, never used: idle from its load
    clock.now = 10
    memory.add("b", 100)
    memory.acquire("b")
    clock.now = 20
    memory.release("b")  # last used at 20
    clock.now = 609
    assert memory.idle(600) == ["a"]
    clock.now = 620
    assert memory.idle(600) == ["a", "b"]
    assert memory.idle(0) == []  # 0: never for idleness


def test_a_model_in_use_is_never_idle_however_long_it_runs() -> None:
    clock = Still()
    memory = ModelMemory(budget=300, clock=clock)
    memory.add("a", 100)
    memory.acquire("a")  # a chunk holds it for an hour
    clock.now = 3600
    assert memory.idle(600) == []
    memory.release("a")  # its idle time starts now
    assert memory.idle(600) == []
    clock.now = 4200
    assert memory.idle(600) == ["a"]


def test_idle_unloads_are_counted_apart_from_the_budgets() -> None:
    memory = ModelMemory(budget=300)
    memory.add("a", 100)
    memory.add("b", 100)
    memory.unload("a", idle=True)
    memory.unload("b")
    memory.unload("b")  # no longer loaded: not counted twice
    assert (memory.idle_unloads, memory.evictions, memory.used()) == (1, 1, 0)


def test_rss_is_this_process_resident_memory() -> None:
    mine = rss_bytes()
    if not Path("/proc/self/statm").is_file():
        assert mine is None  # not Linux: unknown, never 0
        return
    assert mine is not None and 10 * 2**20 < mine < 64 * 2**30
    assert rss_bytes(os.getpid()) == pytest.approx(mine, rel=0.5)
    assert rss_bytes(2**22 + 7) is None  # no such process
