"""Helpers shared by the fast tests: migrated SQLite settings and fake dispatchers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class Enqueued:
    job_id: str
    chunk: int
    item_ids: list[int]
    queue: str


@dataclass
class RecordingDispatcher:
    """A `Dispatcher` that only remembers what it was asked to send."""

    calls: list[Enqueued] = field(default_factory=list)

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        self.calls.append(Enqueued(job_id, chunk, list(item_ids), queue))


class BrokenDispatcher:
    """A `Dispatcher` whose broker is down."""

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        raise ConnectionError("Connection refused")
