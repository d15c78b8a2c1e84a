"""Helpers shared by the fast tests: migrated SQLite settings."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.app.core.config import Settings, get_settings
from kiln.app.db.migrate import upgrade


def migrated_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object
) -> Settings:
    """Embedded defaults under `tmp_path` (SQLite, local store, filesystem broker), migrated.

    No `KILN_*` variable from the host leaks in.
    """
    for name in list(os.environ):
        if name.upper().startswith("KILN_"):
            monkeypatch.delenv(name)
    settings = get_settings(data_dir=tmp_path / "data", **overrides)
    upgrade(settings)
    return settings


def run_torch_child(script: str, folder: Path, env: dict[str, str] | None = None) -> None:
    """Run `script` (which imports torch) in a child interpreter with `folder` as its argument,
    from the repository root and without the host's `KILN_*` settings; this process stays as
    torch-free as a worker is."""
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("KILN_")}
    with loads_no_torch():
        result = subprocess.run(
            [sys.executable, "-c", script, str(folder)],
            cwd=Path(__file__).resolve().parents[1], env={**clean, **(env or {})},
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


@contextlib.contextmanager
def loads_no_torch() -> Iterator[None]:
    """What runs inside imports no torch into this process. Where an earlier test in the same
    process loaded it (`kiln run` of text-embed runs its model in-process), nothing can tell."""
    loaded = "torch" in sys.modules
    yield
    assert loaded or "torch" not in sys.modules
