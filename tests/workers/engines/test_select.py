"""Which backend `auto` takes, and why — for every kind of host, without one."""

from __future__ import annotations

import pytest

from kiln.workers.engines.select import (
    BackendUnavailableError,
    Choice,
    Host,
    choose,
    runner_count,
)
from kiln.workers.ops.device import Gpu

A10G = Gpu(0, "NVIDIA A10G", "GPU-a", (8, 6), 24 * 2**30)
CPU = ("CPUExecutionProvider",)
CUDA = ("CUDAExecutionProvider", "CPUExecutionProvider")


def host(tensorrt: bool = False, gpus: tuple[Gpu, ...] = (), ort: tuple[str, ...] = CPU) -> Host:
    return Host(tensorrt=tensorrt, gpus=gpus, ort_providers=ort, cpus=8)


@pytest.mark.parametrize(
    ("machine", "backend", "why"),
    [
        (host(tensorrt=True, gpus=(A10G,), ort=CUDA), "tensorrt", "tensorrt imports and 1 GPU"),
        (host(tensorrt=True, gpus=(A10G,)), "tensorrt", "NVIDIA A10G"),
        (host(gpus=(A10G,), ort=CUDA), "onnxruntime-cuda", "tensorrt is not installed"),
        (host(gpus=(A10G,)), "onnxruntime-cpu", "no GPU backend installed"),
        (host(tensorrt=True, ort=CUDA), "onnxruntime-cpu", "no GPU is visible"),
        (host(), "onnxruntime-cpu", "no GPU is visible"),
    ],
)
def test_auto(machine: Host, backend: str, why: str) -> None:
    choice = choose(machine)
    assert choice.backend == backend
    assert why in choice.reason


def test_a_backend_asked_for_must_be_possible() -> None:
    with pytest.raises(BackendUnavailableError, match="no GPU is visible"):
        choose(host(tensorrt=True), "tensorrt")
    with pytest.raises(BackendUnavailableError, match="tensorrt package is not installed"):
        choose(host(gpus=(A10G,)), "tensorrt")
    with pytest.raises(BackendUnavailableError, match="onnxruntime-gpu is not installed"):
        choose(host(gpus=(A10G,)), "onnxruntime-cuda")
    assert choose(host(tensorrt=True, gpus=(A10G,)), "onnxruntime-cpu").backend == "onnxruntime-cpu"
    with pytest.raises(ValueError, match="Unknown engine backend"):
        choose(host(), "magic")


def test_runner_count() -> None:
    cpu, gpu = Choice("onnxruntime-cpu", ""), Choice("tensorrt", "")
    assert runner_count(0, cpu, host()) == 8  # one per core, one thread each
    assert runner_count(0, gpu, host()) == 2  # copies of one batch overlap the other's compute
    assert runner_count(3, gpu, host()) == 3


def test_the_probe_runs_here_without_a_gpu() -> None:
    probed = Host.probe()
    assert probed.gpus == () and "CPUExecutionProvider" in probed.ort_providers
    assert probed.tensorrt is False  # tensorrt-stubs alone is not TensorRT
    assert choose(probed).backend == "onnxruntime-cpu"
