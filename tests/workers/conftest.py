"""A worker runtime over SQLite and a local store, with a tiny real ONNX classifier
registered as `colours`: what `process_chunk` tests run against, without a broker.

Prep runs on the chunk's own thread here (`KILN_PREP_PROCESSES=0`: the same units, no
processes to start per test); tests/workers/prep runs the real pool, and the integration and
embedded tests run workers as deployed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.app.core.config import Settings
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings
from tests.workers.colours import colours_runtime


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(
        tmp_path, monkeypatch, chunk_size=3, max_batch=8, max_delay_ms=2, prep_processes=0
    )


@pytest.fixture
def runtime(settings: Settings, tmp_path: Path) -> Iterator[WorkerRuntime]:
    with colours_runtime(settings, tmp_path) as runtime:
        yield runtime
