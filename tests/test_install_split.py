"""The two install flavours never meet: `kiln[gpu]` resolves without `onnxruntime` (the CPU
wheel, which shadows onnxruntime-gpu's CUDA provider when both are installed) and `kiln[cpu]`
has it. Nothing here installs anything.

What each test checks, honestly:
- the core's closure is walked over the metadata installed in this environment (every core
  dependency is installed here), following markers and extras, offline;
- the `gpu` extra is resolved by pip from PyPI (`--dry-run --ignore-installed --report`:
  metadata only, no wheel downloaded), all but tensorrt-cu12, whose own requirements
  (tensorrt-cu12-libs and -bindings) are sdists that download from NVIDIA's index to say anything:
  for it, only its direct requirements are read. `gpu-libs` adds only the `cuda`/`cudnn` extras
  of onnxruntime-gpu and the `ctk` extra of CuPy: their requirement strings are read from the
  resolved metadata (CUDA 12 library wheels), not resolved themselves (their indexes are large:
  that would take half a minute more);
- the packages a GPU install takes with `--no-deps` (constraints/gpu-no-deps.txt) are read from
  their installed metadata: everything they need but onnxruntime is in the core or `gpu`.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NO_DEPS = ROOT / "constraints" / "gpu-no-deps.txt"
# Same `cv2` module: rapidocr-onnxruntime asks for opencv-python, the core has the headless one.
SAME_MODULE = {"opencv-python": "opencv-python-headless"}
PIP_DRY_RUN = (sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--quiet", "--report", "-")  # fmt: skip


def declared(extra: str | None = None) -> list[Requirement]:
    """The project's own requirements for `extra` (None: the core), `kiln[...]` expanded."""
    raw = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    found: list[Requirement] = []
    for text in raw:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "kiln":
            found += [r for e in sorted(requirement.extras) for r in declared(e)]
        else:
            found.append(requirement)
    return found


def names(requirements: Iterable[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements}


def applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": e}) for e in (*extras, ""))


def installed_closure(roots: Iterable[Requirement]) -> set[str]:
    """Every distribution `roots` pull in, from this environment's installed metadata."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [r for r in roots if applies(r, ())]
    while todo:
        requirement = todo.pop()
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(requirement.name) or []
        except importlib.metadata.PackageNotFoundError as error:
            raise AssertionError(f"{requirement.name} is not installed: cannot walk") from error
        todo += [r for r in map(Requirement, requires) if applies(r, requirement.extras)]
    return {name for name, _ in seen}


def pip_resolve(requirements: Iterable[Requirement], *flags: str) -> list[dict[str, Any]]:
    """What pip would install for `requirements` on a bare Python like this one (PyPI)."""
    done = subprocess.run(
        [*PIP_DRY_RUN, *flags, *map(str, requirements)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout)["install"])


def test_no_extra_names_both_onnxruntime_wheels() -> None:
    model_files = {"nudenet", "rapidocr-onnxruntime"}  # they require onnxruntime (CPU)
    assert not names(declared()) & ({"onnxruntime", "onnxruntime-gpu"} | model_files)
    assert {"onnxruntime", *model_files} <= names(declared("cpu"))
    assert "onnxruntime-gpu" not in names(declared("cpu"))
    for extra in ("gpu", "gpu-libs"):
        assert "onnxruntime-gpu" in names(declared(extra))
        assert not names(declared(extra)) & ({"onnxruntime"} | model_files)


def test_the_core_pulls_no_onnxruntime_and_cpu_does() -> None:
    core = installed_closure(declared())
    assert not core & {"onnxruntime", "onnxruntime-gpu", "nudenet", "rapidocr-onnxruntime"}
    assert "onnxruntime" in installed_closure(declared("cpu"))  # the walk does find it


def test_the_no_deps_packages_need_nothing_the_gpu_install_lacks() -> None:
    taken = [Requirement(line) for line in NO_DEPS.read_text().splitlines()
             if line.strip() and not line.startswith("#")]  # fmt: skip
    assert names(taken) == {"nudenet", "rapidocr-onnxruntime"}
    available = installed_closure(declared()) | names(declared("gpu"))
    for package in taken:
        needs = {
            SAME_MODULE.get(name, name)
            for name in names(
                r for r in map(Requirement, importlib.metadata.requires(package.name) or [])
                if applies(r, ())
            )
        }  # fmt: skip
        assert "onnxruntime" in needs  # why it is taken with --no-deps at all
        assert needs - {"onnxruntime"} <= available, (package.name, needs - available)


def extra_requirements(metadata: dict[str, Any], extra: str) -> list[str]:
    return [r for r in metadata.get("requires_dist", []) if f'extra == "{extra}"' in r]


def test_the_gpu_extra_resolves_without_onnxruntime() -> None:
    gpu = [r for r in declared("gpu") if r.name != "tensorrt-cu12"]
    resolved = {
        str(canonicalize_name(i["metadata"]["name"])): i["metadata"] for i in pip_resolve(gpu)
    }
    assert "onnxruntime" not in resolved
    assert {"onnxruntime-gpu", "cupy-cuda12x", "nvidia-ml-py", "pyclipper"} <= set(resolved)
    assert Version(resolved["onnxruntime-gpu"]["version"]) < Version("1.27")  # CUDA 12 builds

    # `gpu-libs` adds these two packages' own extras: CUDA 12 library wheels, never CUDA 13.
    libs = names(declared("gpu-libs")) - names(declared("gpu"))
    assert not libs, libs  # only extras of packages `gpu` already has
    cuda = extra_requirements(resolved["onnxruntime-gpu"], "cuda")
    cudnn = extra_requirements(resolved["onnxruntime-gpu"], "cudnn")
    assert cuda and cudnn and all("-cu12" in r for r in cuda + cudnn), cuda + cudnn
    (ctk,) = extra_requirements(resolved["cupy-cuda12x"], "ctk")
    assert Requirement(ctk).specifier == SpecifierSet("==12.*"), ctk

    (tensorrt,) = pip_resolve([r for r in declared("gpu") if r.name == "tensorrt-cu12"],
                              "--no-deps")  # fmt: skip
    needs = names(Requirement(r) for r in tensorrt["metadata"]["requires_dist"])
    assert needs - {"numpy"} == {"tensorrt-cu12-libs", "tensorrt-cu12-bindings"}
