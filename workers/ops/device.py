"""GPUs: discovery and telemetry through NVML, and pinning a worker process to one device.

NVML reads the driver without creating a CUDA context, so discovery is safe in a parent that
will fork. Nothing here invents a number: a metric the device does not report is absent.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

CUDA_MODULES = ("cupy", "tensorrt", "torch", "pycuda")  # importing these may touch CUDA


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML index: the physical device number
    name: str
    uuid: str
    compute_capability: tuple[int, int]
    memory_bytes: int

    @property
    def slug(self) -> str:
        """Name and compute capability, safe in a storage key: `nvidia-a10g-sm86`."""
        name = "".join(c if c.isalnum() else "-" for c in self.name.lower()).strip("-")
        return f"{name}-sm{self.compute_capability[0]}{self.compute_capability[1]}"


def nvml() -> Any:
    """pynvml (a module), initialised; None without the library or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        log.debug("NVML unavailable: %s", error)
        return None
    return pynvml


def visible(indices: list[int], uuids: list[str], env: str | None) -> list[int]:
    """The NVML indices CUDA will see given `CUDA_VISIBLE_DEVICES` (indices or UUIDs)."""
    if env is None:
        return list(indices)
    chosen: list[int] = []
    for part in (p.strip() for p in env.split(",")):
        if not part:
            continue
        if part.isdigit() and int(part) in indices:
            chosen.append(int(part))
        elif part.startswith(("GPU-", "MIG-")) and part in uuids:
            chosen.append(indices[uuids.index(part)])
        else:
            break  # CUDA stops at the first entry it cannot match
    return chosen


def list_gpus() -> list[Gpu]:
    """The GPUs this process may use, in CUDA's order; empty without NVML or devices."""
    lib = nvml()
    if lib is None:
        return []
    try:
        handles = [lib.nvmlDeviceGetHandleByIndex(i) for i in range(lib.nvmlDeviceGetCount())]
        gpus = [_describe(lib, i, h) for i, h in enumerate(handles)]
    except lib.NVMLError as error:
        log.warning("NVML could not list devices: %s", error)
        return []
    order = visible(
        [g.index for g in gpus], [g.uuid for g in gpus], os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    return [gpus[i] for i in order]


def _describe(lib: Any, index: int, handle: Any) -> Gpu:
    name = lib.nvmlDeviceGetName(handle)
    uuid = lib.nvmlDeviceGetUUID(handle)
    major, minor = lib.nvmlDeviceGetCudaComputeCapability(handle)
    memory = lib.nvmlDeviceGetMemoryInfo(handle)
    return Gpu(
        index,
        name.decode() if isinstance(name, bytes) else str(name),
        uuid.decode() if isinstance(uuid, bytes) else str(uuid),
        (int(major), int(minor)),
        int(memory.total),
    )


def pin(index: int) -> None:
    """Make device `index` the only one this process sees. Must run before any CUDA library
    is imported (CUDA reads the variable once, when it initialises)."""
    loaded = [m for m in CUDA_MODULES if m in sys.modules]
    if loaded:
        raise RuntimeError(
            f"Cannot pin GPU {index}: {', '.join(loaded)} already imported in this process."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)


# What `GpuTelemetry.read` answers, per GPU: key → (metric, help).
GPU_GAUGES = {
    "util": ("kiln_gpu_utilization_ratio", "Share of time a kernel ran (NVML)."),
    "used": ("kiln_gpu_memory_used_bytes", "Device memory in use."),
    "total": ("kiln_gpu_memory_total_bytes", "Device memory in all."),
    "temp": ("kiln_gpu_temperature_celsius", "GPU core temperature."),
    "power": ("kiln_gpu_power_watts", "Power drawn by the board."),
}


class GpuTelemetry(Collector):
    """Utilisation, memory, temperature and power of the visible GPUs, read at scrape time."""

    def __init__(self, gpus: list[Gpu] | None = None) -> None:
        self.lib = nvml()
        self.gpus = gpus if gpus is not None else list_gpus()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.lib is None or not self.gpus:
            return
        families = {
            key: GaugeMetricFamily(name, text, labels=["gpu"])
            for key, (name, text) in GPU_GAUGES.items()
        }
        for gpu in self.gpus:
            for key, value in self.read(gpu).items():
                families[key].add_metric([str(gpu.index)], value)
        yield from (f for f in families.values() if f.samples)

    def read(self, gpu: Gpu) -> dict[str, float]:
        """What NVML reports for `gpu` now (util as a ratio, bytes, °C, W): a key per figure
        the board answered; empty without NVML."""
        lib, values = self.lib, dict[str, float]()
        if lib is None:
            return values
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(gpu.index)
        except lib.NVMLError:
            return values
        readers: dict[str, Callable[[], float]] = {
            "util": lambda: lib.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0,
            "used": lambda: float(lib.nvmlDeviceGetMemoryInfo(handle).used),
            "total": lambda: float(lib.nvmlDeviceGetMemoryInfo(handle).total),
            "temp": lambda: float(lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU)),
            "power": lambda: lib.nvmlDeviceGetPowerUsage(handle) / 1000.0,  # mW → W
        }
        for key, read in readers.items():
            try:
                values[key] = read()
            except lib.NVMLError:
                continue  # not supported on this board: absent, not zero
        return values
