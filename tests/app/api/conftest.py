"""API fixtures: the app on the embedded defaults, and clients for two tenants."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import StarletteDeprecationWarning

from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.tenants.auth import create_key

with warnings.catch_warnings():
    # Starlette 1.x warns when its TestClient falls back to `httpx` because `httpx2` (its
    # preferred client) is not installed; the fallback works the same for these tests.
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
def new_key(sessions: sessionmaker[Session]) -> Callable[[str], str]:
    def make(tenant: str) -> str:
        with sessions() as session:
            key = create_key(session, tenant)
            session.commit()
        return key.secret

    return make


@pytest.fixture
def client(settings: Settings, new_key: Callable[[str], str]) -> Iterator[TestClient]:
    """A client for tenant `acme`."""
    with TestClient(create_app(settings), headers=bearer(new_key("acme"))) as http:
        yield http
    gc.collect()  # finalize this test's request objects while its warning filters apply


@pytest.fixture
def other(client: TestClient, new_key: Callable[[str], str]) -> dict[str, str]:
    """Headers for tenant `globex`, on the same app."""
    return bearer(new_key("globex"))
