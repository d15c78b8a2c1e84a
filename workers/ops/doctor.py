"""`kiln doctor`: which GPU piece this host lacks, and what each engine backend would do here.

`probe()` looks once (NVML, imports, the CUDA libraries the loader finds, installed
distributions) and returns a value; `findings` and `verdicts` are pure functions of it, so every
sentence is tested with made-up probes on a CPU. The backend order and rules follow
`workers.engines.select` (`auto`), stricter where a build would fail later: TensorRT's engine
keeps its buffers in CuPy, and the CUDA provider needs cuDNN and cuBLAS at session creation.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.workers.ops.device import Gpu, list_gpus

# Distributions whose presence (and version) the sentences name.
DISTRIBUTIONS = (
    "onnxruntime", "onnxruntime-gpu", "tensorrt-cu12", "tensorrt", "tensorrt-stubs",
    "cupy-cuda12x", "nvidia-ml-py", "torch", "onnx2fx",
)  # fmt: skip
# What ONNX Runtime's CUDA 12 provider opens when a session starts (cuDNN 9, CUDA 12 libraries).
CUDA_PROVIDER_LIBS = (
    "libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcufft.so.11",
    "libcurand.so.10", "libcudnn.so.9",
)  # fmt: skip
CUDA_EP = "CUDAExecutionProvider"


@dataclass(frozen=True)
class Attempt:
    """One thing tried: `detail` is what loaded (a version) or, when not `ok`, why not."""

    ok: bool
    detail: str


@dataclass(frozen=True)
class Probe:
    """What this host has, as `kiln doctor` saw it."""

    distributions: Mapping[str, str]  # installed name → version, of DISTRIBUTIONS
    nvml: Attempt  # the NVIDIA driver through NVML (its version)
    gpus: tuple[Gpu, ...]
    tensorrt: Attempt
    cupy: Attempt
    nvrtc: Attempt  # NVRTC as CuPy loads it (CuPy compiles its kernels with it)
    onnxruntime: Attempt
    ort_providers: tuple[str, ...] = ()
    cuda_libs: Mapping[str, Attempt] = field(default_factory=dict)  # CUDA_PROVIDER_LIBS
    torch: Attempt = Attempt(False, "not installed")
    torch_cuda: bool = False  # asked only when a GPU is visible, as select.Host does


@dataclass(frozen=True)
class Finding:
    piece: str
    ok: bool
    sentence: str


@dataclass(frozen=True)
class Verdict:
    backend: str
    usable: bool
    reason: str


def ort_conflict(probe: Probe) -> str | None:
    """The classic cause of a missing CUDA provider: both ONNX Runtime wheels installed."""
    cpu, gpu = probe.distributions.get("onnxruntime"), probe.distributions.get("onnxruntime-gpu")
    if cpu is None or gpu is None:
        return None
    return (
        f"both onnxruntime {cpu} (CPU) and onnxruntime-gpu {gpu} are installed: they share the "
        "`onnxruntime` module and the one installed last wins, usually without the CUDA "
        "provider; `pip uninstall -y onnxruntime onnxruntime-gpu`, then install `kiln[gpu]` "
        "and `pip install --no-deps -r constraints/gpu-no-deps.txt`"
    )


def _driver(probe: Probe) -> Finding:
    if not probe.nvml.ok:
        return Finding("NVIDIA driver", False, f"NVML is unavailable: {probe.nvml.detail}")
    return Finding("NVIDIA driver", True, f"NVML answers (driver {probe.nvml.detail})")


def _gpus(probe: Probe) -> Finding:
    if not probe.gpus:
        why = "NVML lists none this process may use (check CUDA_VISIBLE_DEVICES)"
        return Finding("GPUs", False, why if probe.nvml.ok else "none visible without NVML")
    names = ", ".join(f"{g.index}: {g.name} sm{g.compute_capability[0]}{g.compute_capability[1]}"
                      for g in probe.gpus)  # fmt: skip
    return Finding("GPUs", True, f"{len(probe.gpus)} visible ({names})")


def _library(piece: str, attempt: Attempt) -> Finding:
    sentence = f"imports ({attempt.detail})" if attempt.ok else attempt.detail
    return Finding(piece, attempt.ok, sentence)


def _provider(probe: Probe) -> Finding:
    piece = "ONNX Runtime CUDA provider"
    if CUDA_EP in probe.ort_providers:
        return Finding(piece, True, "CUDAExecutionProvider is listed")
    conflict = ort_conflict(probe)
    if conflict:
        return Finding(piece, False, f"missing: {conflict}")
    if not probe.onnxruntime.ok:
        return Finding(piece, False, "missing: onnxruntime does not import")
    if "onnxruntime-gpu" in probe.distributions:
        version = probe.distributions["onnxruntime-gpu"]
        return Finding(piece, False, f"missing although onnxruntime-gpu {version} is installed")
    return Finding(piece, False, "missing: onnxruntime-gpu is not installed (`kiln[gpu]`)")


def _cuda_libs(probe: Probe) -> Finding:
    missing = [name for name, attempt in probe.cuda_libs.items() if not attempt.ok]
    if not missing:
        return Finding("CUDA 12 / cuDNN 9 libraries", True, "the loader finds all of them")
    return Finding(
        "CUDA 12 / cuDNN 9 libraries",
        False,
        f"the loader cannot open {', '.join(missing)}: install CUDA 12 and cuDNN 9 (or "
        "`kiln[gpu-libs]` and put their lib folders on LD_LIBRARY_PATH), or use the gpu image",
    )


def _torch(probe: Probe) -> Finding:
    if not probe.torch.ok:
        return Finding("PyTorch CUDA", False, probe.torch.detail)
    if probe.torch_cuda:
        return Finding("PyTorch CUDA", True, f"torch {probe.torch.detail} sees CUDA")
    why = "no GPU is visible" if not probe.gpus else "torch.cuda.is_available() is False"
    return Finding("PyTorch CUDA", False, f"torch {probe.torch.detail}, but {why}")


def findings(probe: Probe) -> list[Finding]:
    """Every GPU piece, in the order a GPU install needs them, each with its sentence."""
    found = [
        _driver(probe),
        _gpus(probe),
        _library("TensorRT", probe.tensorrt),
        _library("CuPy", probe.cupy),
        Finding("NVRTC", probe.nvrtc.ok, probe.nvrtc.detail),
        _library("ONNX Runtime", probe.onnxruntime),
        _provider(probe),
    ]
    if CUDA_EP in probe.ort_providers:  # the libraries matter only to the CUDA provider
        found.append(_cuda_libs(probe))
    found.append(_torch(probe))
    return found


def _tensorrt(probe: Probe) -> Verdict:
    if not probe.tensorrt.ok:
        return Verdict("tensorrt", False, f"TensorRT: {probe.tensorrt.detail}")
    if not probe.gpus:
        return Verdict("tensorrt", False, "tensorrt imports, but no GPU is visible")
    if not probe.cupy.ok:
        return Verdict("tensorrt", False, "tensorrt imports, but the engine's buffers need "
                       f"CuPy: {probe.cupy.detail}; its build would fail")  # fmt: skip
    if not probe.nvrtc.ok:
        return Verdict("tensorrt", False, "tensorrt and CuPy import, but CuPy cannot compile "
                       f"its kernels without NVRTC: {probe.nvrtc.detail}")  # fmt: skip
    return Verdict("tensorrt", True, f"tensorrt {probe.tensorrt.detail}, CuPy and a GPU")


def _ort_cuda(probe: Probe) -> Verdict:
    provider = _provider(probe)
    if not provider.ok:
        return Verdict("onnxruntime-cuda", False, f"the CUDA provider is {provider.sentence}")
    if not probe.gpus:
        return Verdict("onnxruntime-cuda", False, "the CUDA provider is there, but no GPU")
    libs = _cuda_libs(probe)
    if not libs.ok:
        return Verdict("onnxruntime-cuda", False, f"sessions would fall back to the CPU: "
                       f"{libs.sentence}")  # fmt: skip
    return Verdict("onnxruntime-cuda", True, "the CUDA provider, its libraries and a GPU")


def _torch_cuda(probe: Probe) -> Verdict:
    torch = _torch(probe)
    if torch.ok and "onnx2fx" not in probe.distributions:  # the ONNX → torch converter
        why = f"{torch.sentence}, but onnx2fx is not installed (`kiln[torch-engine]`)"
        return Verdict("torch-cuda", False, why)
    return Verdict("torch-cuda", torch.ok and bool(probe.gpus), torch.sentence)


def _ort_cpu(probe: Probe) -> Verdict:
    if not probe.onnxruntime.ok:
        return Verdict("onnxruntime-cpu", False, f"ONNX Runtime: {probe.onnxruntime.detail} "
                       "(install `kiln[cpu]` or `kiln[gpu]`)")  # fmt: skip
    return Verdict("onnxruntime-cpu", True, f"onnxruntime {probe.onnxruntime.detail}")


def verdicts(probe: Probe) -> list[Verdict]:
    """Each backend, in `auto`'s order of preference, usable here or not, and why."""
    return [_tensorrt(probe), _ort_cuda(probe), _torch_cuda(probe), _ort_cpu(probe)]


def chosen(judged: list[Verdict]) -> str | None:
    """The backend `auto` would build with first: the best usable one."""
    return next((v.backend for v in judged if v.usable), None)


def report(probe: Probe) -> dict[str, Any]:
    """The whole diagnosis as plain data (`kiln doctor --json`)."""
    judged = verdicts(probe)
    return {
        "checks": [asdict(f) for f in findings(probe)],
        "backends": [asdict(v) for v in judged],
        "chosen": chosen(judged),
        "conflict": ort_conflict(probe),
    }


# --- the probe: the only part that touches the host -------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


def _distributions() -> dict[str, str]:
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _nvml() -> Attempt:
    if importlib.util.find_spec("pynvml") is None:
        return Attempt(False, "nvidia-ml-py is not installed (`kiln[gpu]`)")
    import pynvml

    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as error:
        return Attempt(False, f"{_first_line(error)} (is the NVIDIA driver installed?)")
    return Attempt(True, version.decode() if isinstance(version, bytes) else str(version))


def _import(module: str, package: str) -> tuple[Attempt, Any]:
    """Import `module`; a spec without an origin is a stub-only namespace (tensorrt-stubs)."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return Attempt(False, f"{package} is not installed"), None
    if spec.origin is None:
        return Attempt(False, f"only type stubs for {module} are installed, not {package}"), None
    try:
        loaded = importlib.import_module(module)
    except Exception as error:  # a broken install (a missing shared library) is "not usable"
        return Attempt(False, f"{package} is installed but does not import: "
                       f"{_first_line(error)}"), None  # fmt: skip
    return Attempt(True, str(getattr(loaded, "__version__", "?"))), loaded


def _nvrtc(cupy: Any) -> Attempt:
    if cupy is None:
        return Attempt(False, "not tried: CuPy does not import")
    try:
        major, minor = cupy.cuda.nvrtc.getVersion()
    except Exception as error:  # CuPy raises its own error types when the library is missing
        return Attempt(False, f"CuPy cannot load NVRTC: {_first_line(error)}")
    return Attempt(True, f"NVRTC {major}.{minor}")


def _dlopen(name: str) -> Attempt:
    try:
        ctypes.CDLL(name)
    except OSError as error:
        return Attempt(False, _first_line(error))
    return Attempt(True, name)


def _torch_cuda_available(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a driver mismatch raises here on some builds: no CUDA for torch
        return False


def _torch_probe(installed: Mapping[str, str], gpus: tuple[Gpu, ...]) -> tuple[Attempt, Any]:
    """Imported only when a GPU is visible, as `select.Host.probe` does: it is slow and,
    without a GPU, torch-cuda is out whatever torch says."""
    if "torch" not in installed:
        return Attempt(False, "torch is not installed (`kiln[torch]`)"), None
    if not gpus:
        return Attempt(True, installed["torch"]), None
    return _import("torch", "torch")


def probe() -> Probe:
    """Look at this host. Imports CUDA libraries: run it in its own process (`kiln doctor`),
    never in a worker parent that will fork."""
    gpus = tuple(list_gpus())
    tensorrt, trt = _import("tensorrt", "tensorrt-cu12")
    if trt is not None and not hasattr(trt, "Builder"):
        tensorrt = Attempt(False, "tensorrt imports but has no Builder (a partial install)")
    cupy, cp = _import("cupy", "cupy-cuda12x")
    onnxruntime, ort = _import("onnxruntime", "onnxruntime")
    providers = tuple(ort.get_available_providers()) if ort is not None else ()
    installed = _distributions()
    torch, th = _torch_probe(installed, gpus)
    return Probe(
        distributions=installed,
        nvml=_nvml(),
        gpus=gpus,
        tensorrt=tensorrt,
        cupy=cupy,
        nvrtc=_nvrtc(cp),
        onnxruntime=onnxruntime,
        ort_providers=providers,
        cuda_libs={name: _dlopen(name) for name in CUDA_PROVIDER_LIBS},
        torch=torch,
        torch_cuda=bool(gpus) and th is not None and _torch_cuda_available(th),
    )
