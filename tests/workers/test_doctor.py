"""`kiln doctor`'s diagnosis over made-up probes: each missing GPU piece yields its sentence,
and each backend's verdict follows (no GPU here; the probe itself runs in the CLI test)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kiln.workers.ops import doctor
from kiln.workers.ops.device import Gpu
from kiln.workers.ops.doctor import CUDA_PROVIDER_LIBS, Attempt, Probe

A10 = Gpu(0, "NVIDIA A10G", "GPU-1", (8, 6), 24 << 30)
FOUND = {name: Attempt(True, name) for name in CUDA_PROVIDER_LIBS}
GPU_WHEELS = {"onnxruntime-gpu": "1.26.0", "tensorrt-cu12": "10.16.1.11",
              "cupy-cuda12x": "13.6.0", "nvidia-ml-py": "13.615.71"}  # fmt: skip

# A GPU host with everything: the `gpu` image on an A10G.
HEALTHY = Probe(
    distributions=GPU_WHEELS,
    nvml=Attempt(True, "570.124.06"),
    gpus=(A10,),
    tensorrt=Attempt(True, "10.16.1.11"),
    cupy=Attempt(True, "13.6.0"),
    nvrtc=Attempt(True, "NVRTC 12.6"),
    onnxruntime=Attempt(True, "1.26.0"),
    ort_providers=("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"),
    cuda_libs=FOUND,
    torch=Attempt(False, "torch is not installed (`kiln[torch]`)"),
)


def check(probe: Probe, piece: str) -> doctor.Finding:
    return next(f for f in doctor.findings(probe) if f.piece == piece)


def verdict(probe: Probe, backend: str) -> doctor.Verdict:
    return next(v for v in doctor.verdicts(probe) if v.backend == backend)


def test_a_healthy_gpu_host_uses_tensorrt() -> None:
    judged = doctor.verdicts(HEALTHY)
    assert [(v.backend, v.usable) for v in judged] == [
        ("tensorrt", True), ("onnxruntime-cuda", True), ("torch-cuda", False),
        ("onnxruntime-cpu", True),
    ]  # fmt: skip
    assert doctor.chosen(judged) == "tensorrt"
    assert all(f.ok for f in doctor.findings(HEALTHY) if f.piece != "PyTorch CUDA")
    assert check(HEALTHY, "GPUs").sentence == "1 visible (0: NVIDIA A10G sm86)"


def test_no_driver() -> None:
    probe = replace(HEALTHY, nvml=Attempt(False, "Driver Not Loaded (is the NVIDIA driver "
                                           "installed?)"), gpus=())  # fmt: skip
    assert check(probe, "NVIDIA driver").sentence == (
        "NVML is unavailable: Driver Not Loaded (is the NVIDIA driver installed?)"
    )
    assert check(probe, "GPUs").sentence == "none visible without NVML"
    assert verdict(probe, "tensorrt").reason == "tensorrt imports, but no GPU is visible"
    assert verdict(probe, "onnxruntime-cuda").reason == "the CUDA provider is there, but no GPU"
    assert doctor.chosen(doctor.verdicts(probe)) == "onnxruntime-cpu"


def test_gpus_hidden_by_cuda_visible_devices() -> None:
    probe = replace(HEALTHY, gpus=())
    assert check(probe, "GPUs").sentence == (
        "NVML lists none this process may use (check CUDA_VISIBLE_DEVICES)"
    )


def test_only_tensorrt_stubs() -> None:
    probe = replace(HEALTHY, tensorrt=Attempt(False, "only type stubs for tensorrt are "
                                              "installed, not tensorrt-cu12"))  # fmt: skip
    assert not check(probe, "TensorRT").ok
    assert verdict(probe, "tensorrt").reason == (
        "TensorRT: only type stubs for tensorrt are installed, not tensorrt-cu12"
    )
    assert doctor.chosen(doctor.verdicts(probe)) == "onnxruntime-cuda"


def test_tensorrt_without_cupy_would_fail_its_build() -> None:
    probe = replace(HEALTHY, cupy=Attempt(False, "cupy-cuda12x is not installed"),
                    nvrtc=Attempt(False, "not tried: CuPy does not import"))  # fmt: skip
    assert verdict(probe, "tensorrt").reason == (
        "tensorrt imports, but the engine's buffers need CuPy: cupy-cuda12x is not installed; "
        "its build would fail"
    )
    assert check(probe, "NVRTC").sentence == "not tried: CuPy does not import"


def test_missing_nvrtc() -> None:
    missing = "CuPy cannot load NVRTC: libnvrtc.so.12: cannot open shared object file"
    probe = replace(HEALTHY, nvrtc=Attempt(False, missing))
    assert check(probe, "NVRTC") == doctor.Finding("NVRTC", False, missing)
    assert verdict(probe, "tensorrt").reason == (
        f"tensorrt and CuPy import, but CuPy cannot compile its kernels without NVRTC: {missing}"
    )
    assert verdict(probe, "onnxruntime-cuda").usable


def test_both_onnxruntime_wheels_is_named_as_the_cause() -> None:
    probe = replace(
        HEALTHY,
        distributions={**HEALTHY.distributions, "onnxruntime": "1.26.0"},
        ort_providers=("AzureExecutionProvider", "CPUExecutionProvider"),
    )
    sentence = check(probe, "ONNX Runtime CUDA provider").sentence
    assert sentence.startswith(
        "missing: both onnxruntime 1.26.0 (CPU) and onnxruntime-gpu 1.26.0 are installed: they "
        "share the `onnxruntime` module"
    )
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in sentence
    assert doctor.report(probe)["conflict"] == sentence.removeprefix("missing: ")
    assert verdict(probe, "onnxruntime-cuda").reason == f"the CUDA provider is {sentence}"


def test_both_wheels_is_reported_even_when_the_provider_survived() -> None:
    probe = replace(HEALTHY, distributions={**HEALTHY.distributions, "onnxruntime": "1.26.0"})
    assert doctor.report(probe)["conflict"] is not None
    assert verdict(probe, "onnxruntime-cuda").usable


@pytest.mark.parametrize(
    ("distributions", "sentence"),
    [
        ({"onnxruntime": "1.32.0"}, "missing: onnxruntime-gpu is not installed (`kiln[gpu]`)"),
        ({"onnxruntime-gpu": "1.26.0"}, "missing although onnxruntime-gpu 1.26.0 is installed"),
    ],
)
def test_no_cuda_provider(distributions: dict[str, str], sentence: str) -> None:
    probe = replace(HEALTHY, distributions=distributions, ort_providers=("CPUExecutionProvider",))
    assert check(probe, "ONNX Runtime CUDA provider").sentence == sentence
    assert not verdict(probe, "onnxruntime-cuda").usable
    assert "CUDA 12 / cuDNN 9 libraries" not in {f.piece for f in doctor.findings(probe)}


def test_missing_cudnn_names_the_library() -> None:
    gone = Attempt(False, "libcudnn.so.9: cannot open shared object file")
    probe = replace(HEALTHY, cuda_libs={**FOUND, "libcudnn.so.9": gone})
    libs = check(probe, "CUDA 12 / cuDNN 9 libraries")
    assert not libs.ok
    assert libs.sentence.startswith("the loader cannot open libcudnn.so.9: install CUDA 12 and ")
    assert verdict(probe, "onnxruntime-cuda").reason == (
        f"sessions would fall back to the CPU: {libs.sentence}"
    )
    assert verdict(probe, "tensorrt").usable  # TensorRT does not need cuDNN


def test_torch_cuda() -> None:
    wheels = {**GPU_WHEELS, "onnx2fx": "0.0.1"}
    probe = replace(
        HEALTHY, distributions=wheels, torch=Attempt(True, "2.7.0+cu126"), torch_cuda=True
    )
    assert verdict(probe, "torch-cuda") == doctor.Verdict(
        "torch-cuda", True, "torch 2.7.0+cu126 sees CUDA"
    )
    no_converter = replace(probe, distributions=GPU_WHEELS)
    assert verdict(no_converter, "torch-cuda") == doctor.Verdict(
        "torch-cuda",
        False,
        "torch 2.7.0+cu126 sees CUDA, but onnx2fx is not installed (`kiln[torch-engine]`)",
    )
    cpu_torch = replace(HEALTHY, torch=Attempt(True, "2.13.0+cpu"))
    assert verdict(cpu_torch, "torch-cuda").reason == (
        "torch 2.13.0+cpu, but torch.cuda.is_available() is False"
    )
    assert verdict(replace(cpu_torch, gpus=()), "torch-cuda").reason == (
        "torch 2.13.0+cpu, but no GPU is visible"
    )


def test_no_backend_at_all() -> None:
    probe = Probe(
        distributions={},
        nvml=Attempt(False, "nvidia-ml-py is not installed (`kiln[gpu]`)"),
        gpus=(),
        tensorrt=Attempt(False, "tensorrt-cu12 is not installed"),
        cupy=Attempt(False, "cupy-cuda12x is not installed"),
        nvrtc=Attempt(False, "not tried: CuPy does not import"),
        onnxruntime=Attempt(False, "onnxruntime is not installed"),
    )
    judged = doctor.verdicts(probe)
    assert doctor.chosen(judged) is None
    assert verdict(probe, "onnxruntime-cpu").reason == (
        "ONNX Runtime: onnxruntime is not installed (install `kiln[cpu]` or `kiln[gpu]`)"
    )
    assert check(probe, "ONNX Runtime CUDA provider").sentence == (
        "missing: onnxruntime does not import"
    )
