"""No secret reaches a log line: settings' repr, the API's startup line, request logs."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import pytest

from kiln.app.api.app import create_app
from kiln.app.core.config import Settings, get_settings, redact_url
from tests.app.api.conftest import TestClient, bearer

PASSWORD = "hunter2-not-for-logs"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql+psycopg://kiln:pw@db:5432/kiln", "postgresql+psycopg://kiln:***@db:5432/kiln"),
        ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://user:p%40ss@redis:6380/1?ssl_cert_reqs=none",
         "rediss://user:***@redis:6380/1?ssl_cert_reqs=none"),
        ("redis://redis:6379/0", "redis://redis:6379/0"),
        ("sqlite:////srv/kiln.db", "sqlite:////srv/kiln.db"),
        ("filesystem://localhost/", "filesystem://localhost/"),
    ],
)  # fmt: skip
def test_redact_url_hides_only_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_settings_repr_and_str_hide_passwords_and_the_api_key() -> None:
    settings = get_settings(
        database_url=f"postgresql+psycopg://kiln:{PASSWORD}@db/kiln",
        broker_url=f"redis://:{PASSWORD}@redis:6379/0",
        api_key=f"kiln_abcd_{PASSWORD}",
    )
    for text in (repr(settings), str(settings), f"{settings!r}"):
        assert PASSWORD not in text
        assert "kiln:***@db/kiln" in text
    assert settings.database_url.endswith(f"kiln:{PASSWORD}@db/kiln")  # the value itself is kept


def test_the_api_logs_neither_passwords_nor_keys(
    settings: Settings, new_key: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    # A Redis broker that is down: the limiter's warning must not carry the password either.
    secret_broker = settings.model_copy(update={"broker_url": f"redis://:{PASSWORD}@127.0.0.1:1/0"})
    key = new_key("acme")
    with caplog.at_level(logging.DEBUG), TestClient(create_app(secret_broker)) as client:
        assert client.get("/v1/jobs", headers=bearer(key)).status_code == 200
        assert client.get("/v1/jobs", headers=bearer(key + "x")).status_code == 401
    gc.collect()
    assert "Kiln API: database sqlite" in caplog.text  # the startup line, redacted
    assert "redis://:***@127.0.0.1:1/0" in caplog.text
    assert "rate limiter unavailable" in caplog.text
    assert PASSWORD not in caplog.text
    assert key not in caplog.text and key.split("_", 2)[2] not in caplog.text  # the secret part
