"""The parts of Kiln's offline GPU bundle, and which downloaded wheels each one carries.

scripts/gpu-bundle.sh downloads each part's requirements (PyPI wheels for the GPU host's
CPython, manylinux x86_64) into a folder of its own, then asks this module which of them to
install: never what a CUDA torch image already has (PRESENT), nor what no GPU run uses
(DROPPED), nor, in an optional part, what the core carries already. docs/gpu.md ("The offline
bundle") says what each part is for; tests/scripts/test_gpu_bundle.py checks these lists.

    python3 scripts/gpu_bundle.py parts                          # the part names, core first
    python3 scripts/gpu_bundle.py requirements PART deps|nodeps  # pip's requirement lines
    python3 scripts/gpu_bundle.py select PART WHEELS [CORE_WHEELS]  # the wheels to install
    python3 scripts/gpu_bundle.py present WHEELS   # the PRESENT ones among them: what core
                                                   # counts on the image for (gpu-unpack.sh checks)
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the lent GPU hosts' image has (Python 3.12, CUDA torch 2.11, torchvision, onnx,
# onnxruntime CPU, pyarrow, ...: docs/gpu.md), as the bundle used there found it. Never
# carried: a second copy would shadow the image's own (torch's CUDA build above all), and
# CUDA's own libraries (nvidia-*) are the image's too unless a part says otherwise. The unpack
# script checks that each is there and names any that is not.
PRESENT = frozenset({
    "torch", "torchvision", "triton", "numpy", "pillow", "onnx", "onnxruntime", "opencv-python",
    "opencv-python-headless", "pyyaml", "jinja2", "markupsafe", "rich", "typer", "click", "httpx",
    "httpcore", "h11", "anyio", "idna", "certifi", "tokenizers", "prometheus-client", "tqdm",
    "six", "psutil", "requests", "urllib3", "packaging", "scipy", "python-dateutil",
    "shellingham", "typing-extensions", "protobuf", "sympy", "mpmath", "networkx", "filelock",
    "fsspec", "charset-normalizer", "humanize", "wrapt", "ml-dtypes", "annotated-doc",
    "cuda-bindings", "cuda-pathfinder", "pyarrow",
})  # fmt: skip

# Pulled in by a requirement, but no GPU run uses them: left out of every part.
# Pulled in by a requirement, but no GPU run imports them (traced: kiln doctor, tests/gpu,
# bench.gpu with its worker row, each process's imports recorded): left out of every part.
_FLOWER = "`kiln flower`'s (the Celery monitor): not run on a GPU host"
_CELERY_SHELL = "`celery shell`'s (click-repl): Kiln's processes never start Celery's own CLI"
_HUB = "huggingface_hub's (tokenizers'): Kiln reads its tokenizer from a file, never from the hub"
DROPPED = {
    "flower": _FLOWER,
    "tornado": _FLOWER,
    "pytz": _FLOWER,
    "click-repl": _CELERY_SHELL,
    "prompt-toolkit": _CELERY_SHELL,
    "wcwidth": _CELERY_SHELL,
    "huggingface-hub": _HUB,
    "hf-xet": _HUB,
    "httpx2": _HUB,
    "httpcore2": _HUB,
    "truststore": _HUB,
    "pywavelets": "imagehash's; Kiln never imports imagehash (phash computes its DCT with "
    "scipy and only reads imagehash's version)",
}

# In pyproject's core list, but carried by an optional part.
MOVED = {"av": "video"}


@dataclass(frozen=True)
class Part:
    why: str
    deps: tuple[str, ...] = ()  # downloaded with their dependencies
    nodeps: tuple[str, ...] = ()  # downloaded alone: what they need is the image's or core's
    cuda_libs: bool = False  # carries CUDA libraries (nvidia-* wheels) of its own


def parts() -> dict[str, Part]:
    """Every part, core first (the others leave out what core carries)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = project["dependencies"]
    gpu = project["optional-dependencies"]["gpu"]
    return {
        "core": Part(
            "Kiln's tree and runtime dependencies: kiln doctor, kiln run, tests/gpu, bench.gpu",
            deps=tuple(r for r in core if requirement_name(r) not in MOVED),
            # the detector's 320n.onnx; the PyTorch backend's ONNX converter (constraints/test.txt)
            nodeps=("nudenet>=3.4", "onnx2fx==0.0.1"),
        ),
        # PostgreSQL and Redis binaries (gpu-bundle.sh takes them: no Python package here)
        "services": Part("PostgreSQL and Redis: `kiln api`, `kiln worker`, bench.gpu's part f"),
        "video": Part("PyAV and its FFmpeg libraries: video inputs", deps=_named(core, "av")),
        "ocr": Part(
            "the built-in OCR model: PP-OCRv4's ONNX files and post-processing",
            deps=_named(gpu, "pyclipper", "shapely"),
            nodeps=("rapidocr-onnxruntime>=1.3",),  # requires onnxruntime: the image's
        ),
        "profile": Part(
            "py-spy (its binary): bench.gpu's profile part, where a kiln run's time goes",
            deps=("py-spy>=0.3",),
        ),
        "decoder": Part(
            "nvImageCodec with nvJPEG (CUDA 13): the second GPU JPEG decoder",
            deps=("nvidia-nvimgcodec-cu13[nvjpeg]>=0.9",),
            cuda_libs=True,
        ),
    }


def _named(requirements: list[str], *names: str) -> tuple[str, ...]:
    return tuple(r for r in requirements if requirement_name(r) in names)


def canonical(name: str) -> str:
    """PEP 503's normal form: `Foo_Bar.baz` → `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """`shapely>=1.7.1,!=2.0.4  # why` → `shapely`."""
    return canonical(re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0])


def wheel_name(path: Path) -> str:
    """`ImageHash-4.3.2-py2.py3-none-any.whl` → `imagehash`."""
    return canonical(path.name.split("-", 1)[0])


def carried(part: str, wheels: list[Path], core_wheels: list[Path] | None = None) -> list[Path]:
    """The wheels of `part` to install: not the image's, not dropped, not already in core."""
    core = [] if part == "core" else carried("core", core_wheels or [])
    in_core = {wheel_name(w) for w in core}
    cuda_libs = parts()[part].cuda_libs
    keep = []
    for wheel in wheels:
        name = wheel_name(wheel)
        if name in PRESENT or name in DROPPED or name in in_core:
            continue
        if name.startswith("nvidia-") and not cuda_libs:
            continue
        keep.append(wheel)
    return keep


def _lines(items: Iterable[str]) -> None:
    """One a line, and nothing at all for none (the shell reads an empty line as an item)."""
    for item in items:
        print(item)


def main(argv: list[str]) -> int:
    match argv:
        case ["parts"]:
            print(" ".join(parts()))
        case ["requirements", part, "deps" | "nodeps" as kind]:
            _lines(getattr(parts()[part], kind))
        case ["select", part, folder, *core]:
            wheels = sorted(Path(folder).glob("*.whl"))
            core_wheels = sorted(Path(core[0]).glob("*.whl")) if core else []
            _lines(str(w) for w in carried(part, wheels, core_wheels))
        case ["present", folder]:
            names = {wheel_name(w) for w in Path(folder).glob("*.whl")}
            _lines(sorted(names & PRESENT))
        case _:
            print(__doc__, file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
