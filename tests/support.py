"""Helpers shared by the fast tests: migrated SQLite settings."""

from __future__ import annotations

import os
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
