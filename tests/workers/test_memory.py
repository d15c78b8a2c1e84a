"""The device-memory budget's arithmetic: sizes a test declares, no device."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.workers.memory import MemoryBudgetFullError, ModelMemory, budget_bytes, engine_bytes


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
