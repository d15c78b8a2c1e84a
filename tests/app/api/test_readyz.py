"""`/readyz` names what is wrong in a sentence, and a fault on the server's side (Kiln's own
bucket missing) answers 503 with its sentence, never a 4xx. On the embedded defaults, with one
part of the app's context swapped for a broken one; the same on the real stack is in
tests/integration/test_setup.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws

from devstack.services import free_port
from kiln.app.api.context import ApiContext
from kiln.app.core.config import Settings, get_settings
from kiln.app.db import migrate
from kiln.app.db.session import make_engine
from kiln.app.dispatch.producer import make_producer
from kiln.app.storage.s3 import S3Store
from tests.app.api.conftest import TestClient

MISSING = "kiln-trial"
SENTENCE = (
    f"Kiln's storage bucket {MISSING} does not exist (KILN_STORAGE_URL); "
    "create it with `kiln storage check --create`."
)


def context(client: TestClient) -> ApiContext:
    kiln: ApiContext = client.app.state.kiln  # type: ignore[attr-defined]
    return kiln


def checks(client: TestClient) -> dict[str, str]:
    answer = client.get("/readyz")
    body = answer.json()
    assert answer.status_code == (200 if body["ready"] else 503), answer.text
    found: dict[str, str] = body["checks"]
    return found


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's in-process S3 with no bucket at all."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        yield boto3.client("s3", region_name="us-east-1")


def test_a_missing_store_bucket_is_named_and_a_submit_is_503(client: TestClient, s3: Any) -> None:
    context(client).store = S3Store(s3, MISSING, "kiln", own=True)
    assert checks(client) == {"database": "ok", "broker": "ok", "storage": SENTENCE}

    answer = client.post(
        "/v1/jobs", data={"model": "phash"}, files=[("files", ("a.png", b"png", "image/png"))]
    )
    assert answer.status_code == 503, answer.text
    assert answer.json() == {"detail": SENTENCE}
    assert answer.headers["Retry-After"]

    s3.create_bucket(Bucket=MISSING)
    assert checks(client) == {"database": "ok", "broker": "ok", "storage": "ok"}


def test_a_database_that_cannot_be_reached_is_named(client: TestClient) -> None:
    port = free_port()  # nothing listens there
    context(client).engine = make_engine(f"postgresql+psycopg://kiln:secret@127.0.0.1:{port}/kiln")
    found = checks(client)
    assert found["database"] == (
        f"The database at postgresql+psycopg://kiln:***@127.0.0.1:{port}/kiln cannot be "
        "reached: Connection refused."
    )
    assert (found["broker"], found["storage"]) == ("ok", "ok")


def test_a_database_not_upgraded_says_to_upgrade(client: TestClient, settings: Settings) -> None:
    empty = make_engine(f"sqlite:///{settings.data_dir / 'empty.db'}")
    context(client).engine = empty
    assert checks(client)["database"] == ("The database has no Kiln tables; run `kiln db upgrade`.")
    behind = get_settings(data_dir=settings.data_dir / "behind")
    older = migrate.scripts().get_revision(migrate.head())
    assert older is not None and isinstance(older.down_revision, str)
    migrate.upgrade(behind, older.down_revision)
    context(client).engine = make_engine(behind.database_url)
    assert checks(client)["database"] == (
        f"The database is at {migrate.describe(older.down_revision)}; this Kiln needs "
        f"{migrate.describe(migrate.head())}: run `kiln db upgrade`."
    )


def test_a_broker_that_cannot_be_reached_is_named(client: TestClient, settings: Settings) -> None:
    port = free_port()
    broken = get_settings(
        data_dir=settings.data_dir, broker_url=f"redis://:secret@127.0.0.1:{port}/0"
    )
    context(client).celery = make_producer(broken)
    found = checks(client)
    assert found["broker"].startswith(f"The broker at redis://:***@127.0.0.1:{port}/0 cannot be")
    assert "Connection refused" in found["broker"] and "secret" not in found["broker"]
    assert (found["database"], found["storage"]) == ("ok", "ok")


@pytest.mark.parametrize(
    ("said", "missing"),
    [
        ("no such table: api_keys", True),
        ("no such column: items.frame_time_s", True),
        ("table items has no column named frame_time_s", True),
        ("database is locked", False),
    ],
)
def test_what_says_the_schema_is_behind(said: str, missing: bool) -> None:
    """SQLite's sentences (PostgreSQL's SQLSTATEs are tried on a real database in
    tests/integration/test_setup.py): a schema behind is the 503 naming `kiln db upgrade`."""
    from sqlalchemy.exc import OperationalError

    from kiln.app.api.errors import _schema_missing

    assert _schema_missing(OperationalError("INSERT …", {}, Exception(said))) is missing


def test_readyz_logs_no_alembic_lines_and_an_upgrade_still_does(
    client: TestClient, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Each /readyz reads the schema's revision; Alembic, which logs its setup each time it is
    configured (nine lines on a process's first call, two after), is not asked. `kiln db
    upgrade` still logs the migrations it runs."""
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):
            assert checks(client)["database"] == "ok"
    assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="alembic"):
        migrate.upgrade(get_settings(data_dir=settings.data_dir / "fresh"))
    ran = [r.getMessage() for r in caplog.records if r.name == "alembic.runtime.migration"]
    assert any(line.startswith("Running upgrade") for line in ran), ran
    assert f"-> {migrate.head()}," in ran[-1]
