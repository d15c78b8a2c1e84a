"""GPU discovery, pinning and telemetry, against a stand-in for NVML (no GPU here)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kiln.workers.ops import device
from kiln.workers.ops.device import Gpu, GpuTelemetry, list_gpus, pin, visible


class NVMLError(Exception):
    pass


@dataclass
class Board:
    name: str
    uuid: str
    cc: tuple[int, int]
    power_mw: int | None = 70_000  # None: the board does not report power


def fake_nvml(boards: list[Board]) -> Any:
    """The few pynvml calls Kiln makes, answering for `boards`."""
    lib = types.SimpleNamespace(NVMLError=NVMLError, NVML_TEMPERATURE_GPU=0)
    lib.nvmlDeviceGetCount = lambda: len(boards)
    lib.nvmlDeviceGetHandleByIndex = lambda i: boards[i]
    lib.nvmlDeviceGetName = lambda b: b.name.encode()
    lib.nvmlDeviceGetUUID = lambda b: b.uuid
    lib.nvmlDeviceGetCudaComputeCapability = lambda b: b.cc
    lib.nvmlDeviceGetMemoryInfo = lambda b: types.SimpleNamespace(total=24 * 2**30, used=2**30)
    lib.nvmlDeviceGetUtilizationRates = lambda b: types.SimpleNamespace(gpu=87)
    lib.nvmlDeviceGetTemperature = lambda b, _sensor: 61

    def power(board: Board) -> int:
        if board.power_mw is None:
            raise NVMLError("Not Supported")
        return board.power_mw

    lib.nvmlDeviceGetPowerUsage = power
    return lib


BOARDS = [
    Board("NVIDIA A10G", "GPU-aaa", (8, 6)),
    Board("NVIDIA L4", "GPU-bbb", (8, 9), power_mw=None),
]


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    lib = fake_nvml(BOARDS)
    monkeypatch.setattr(device, "nvml", lambda: lib)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield lib


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (None, [0, 1, 2]),
        ("", []),
        ("2,0", [2, 0]),
        ("1,7,0", [1]),  # CUDA stops at the first entry it cannot match
        ("GPU-c", [2]),
        ("GPU-b, 0", [1, 0]),
        ("MIG-x", []),
    ],
)
def test_visible_follows_cuda_visible_devices(env: str | None, expected: list[int]) -> None:
    assert visible([0, 1, 2], ["GPU-a", "GPU-b", "GPU-c"], env) == expected


def test_list_gpus_reads_nvml(nvml: Any) -> None:
    gpus = list_gpus()
    assert [(g.index, g.name, g.compute_capability) for g in gpus] == [
        (0, "NVIDIA A10G", (8, 6)),
        (1, "NVIDIA L4", (8, 9)),
    ]
    assert gpus[0].slug == "nvidia-a10g-sm86"


def test_list_gpus_respects_the_pinned_device(nvml: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.name for g in list_gpus()] == ["NVIDIA L4"]


def test_no_nvml_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "nvml", lambda: None)
    assert list_gpus() == []


def test_telemetry_reports_what_the_board_reports(nvml: Any) -> None:
    registry = CollectorRegistry()
    registry.register(GpuTelemetry())
    samples = {
        (s.name, s.labels["gpu"]): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert samples[("kiln_gpu_utilization_ratio", "0")] == pytest.approx(0.87)
    assert samples[("kiln_gpu_temperature_celsius", "1")] == 61
    assert samples[("kiln_gpu_memory_used_bytes", "0")] == 2**30
    assert samples[("kiln_gpu_power_watts", "0")] == 70
    assert ("kiln_gpu_power_watts", "1") not in samples  # not supported: absent, never 0


def test_telemetry_without_a_gpu_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device, "nvml", lambda: None)
    registry = CollectorRegistry()
    registry.register(GpuTelemetry())
    assert b"kiln_gpu" not in generate_latest(registry)


def test_pin_sets_the_device_before_cuda_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in device.CUDA_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pin(3)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


def test_pin_after_cuda_loaded_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    with pytest.raises(RuntimeError, match=r"Cannot pin GPU 0: .*cupy.* already imported"):
        pin(0)


def test_gpu_slug_is_storage_safe() -> None:
    gpu = Gpu(0, "NVIDIA GeForce RTX 4090 (24 GB)", "GPU-x", (8, 9), 0)
    assert gpu.slug == "nvidia-geforce-rtx-4090--24-gb-sm89"
