"""The TensorRT engine's modules type-check against TensorRT 10's API as `tensorrt-stubs` gives it.

The project's own mypy run cannot see those stubs: the package ships `tensorrt/__init__.pyi`
without a `py.typed` marker, so mypy (with `ignore_missing_imports`) reads `tensorrt` as Any,
and its `tensorrt.pyi` has a few syntax errors (parameters named `in`), so making it visible as
is would stop mypy. This test copies the stubs, repairs those lines, and runs mypy --strict with
them on MYPYPATH; a probe with a known mistake proves the stubs were really used.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECKED = [
    "workers/engines/tensorrt.py",
    "workers/engines/engine_cache.py",
    "workers/engines/tensorrt_logic.py",
]
# Known syntax errors in tensorrt-stubs 10.13's tensorrt_bindings/tensorrt.pyi.
STUB_FIXES = [
    (re.compile(r"\((self(?:: IPluginV3)?), in: "), r"(\1, in_: "),
    (
        re.compile(r"power: Weights = None, channel_axis: int\)"),
        "power: Weights = None, channel_axis: int = ...)",
    ),
]
PROBE = """import tensorrt as trt


def inputs(builder: trt.Builder) -> str:
    return builder.create_network(0).num_inputs
"""


def _stub_files() -> list[importlib.metadata.PackagePath]:
    try:
        files = importlib.metadata.distribution("tensorrt-stubs").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return [f for f in files if f.suffix == ".pyi"]


IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = [
    # `make test` and `make check` install the stubs: in CI their absence is a failure.
    pytest.mark.skipif(not _stub_files() and not IN_CI, reason="tensorrt-stubs is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed"),
]


def copy_stubs(target: Path) -> None:
    for file in _stub_files():
        text = Path(str(file.locate())).read_text()
        for pattern, replacement in STUB_FIXES:
            text = pattern.sub(replacement, text)
        destination = target / str(file)
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text)


def test_engine_modules_typecheck_against_the_tensorrt_stubs(tmp_path: Path) -> None:
    stubs = tmp_path / "stubs"
    copy_stubs(stubs)
    probe = tmp_path / "probe_trt.py"
    probe.write_text(PROBE)
    command = [
        sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(tmp_path / "mypy-cache"),
        *CHECKED, str(probe),
    ]  # fmt: skip
    env = {**os.environ, "MYPYPATH": str(stubs)}
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    # The stubs themselves have hundreds of strict-mode complaints; only ours count.
    lines = [line for line in result.stdout.splitlines() if not line.startswith(str(stubs))]
    ours = [line for line in lines if line.startswith("workers/")]
    assert not ours, "\n".join(ours)
    probed = [line for line in lines if line.startswith(str(probe))]
    assert len(probed) == 1 and 'got "int", expected "str"' in probed[0], result.stdout[-2000:]
