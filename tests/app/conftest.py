"""Fixtures for the fast app tests: a migrated SQLite database and a local store in tmp_path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.storage.local import LocalStore
from tests.support import migrated_settings

CHUNK_SIZE = 3


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Embedded defaults in tmp_path, migrated, with small chunks and a small job cap."""
    return migrated_settings(tmp_path, monkeypatch, chunk_size=CHUNK_SIZE, max_files_per_job=10)


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


@pytest.fixture
def session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    with sessions() as session:
        yield session


@pytest.fixture
def store(settings: Settings) -> LocalStore:
    """The folder the settings name (`<data_dir>/objects`)."""
    return LocalStore.from_url(settings.storage_url)


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()
