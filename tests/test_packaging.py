"""`pip install .` puts one import name, `kiln`, into a user's environment."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.egg-info")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    # Built from a copy: setuptools keeps build/ in the source tree, and a stale one would put
    # deleted modules into the wheel.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("kiln", "app", "workers", "migrations"):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=_NOT_SOURCE)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    (path,) = out.glob("kiln-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_holds_only_kiln(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kiln"}


def test_the_wheel_holds_every_layer_and_the_migrations(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for required in (
        "kiln/__init__.py",
        "kiln/app/api/app.py",
        "kiln/app/dispatch/contract.py",
        "kiln/workers/chunk/run.py",
        "kiln/workers/celery/tasks.py",
        "kiln/migrations/env.py",
        "kiln/migrations/script.py.mako",
        "kiln/migrations/versions/0001_initial.py",
        "kiln/app/client/sync.py",
        "kiln/py.typed",  # PEP 561: type checkers read the public client's hints
    ):
        assert required in names
    assert not any(name.startswith(("kiln/tests", "kiln/bench")) for name in names)


def test_the_console_script_is_kiln_under_its_one_name(wheel: zipfile.ZipFile) -> None:
    (entry_points,) = (n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "kiln = kiln.app.cli:main" in wheel.read(entry_points).decode()
