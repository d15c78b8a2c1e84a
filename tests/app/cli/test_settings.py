"""A variable Kiln cannot take stops a command with a sentence naming it, not a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.app.cli.commands import app


def test_a_bad_variable_is_a_sentence_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_LOG_LEVEL", "loud")
    monkeypatch.setenv("KILN_MAX_BATCH", "many")
    result = CliRunner().invoke(app, ["run", "missing-folder", "--model", "phash"])
    assert result.exit_code == 1
    said = " ".join(result.output.split())  # Rich wraps the sentence
    assert "Kiln cannot start with this environment:" in said
    assert "KILN_LOG_LEVEL='loud': Input should be 'debug', 'info', 'warning', 'error'" in said
    # a union's members each say why: an integer, or 'auto'
    assert "KILN_MAX_BATCH='many': Input should be a valid integer" in said
    assert "or Input should be 'auto'" in said
    assert "Traceback" not in said


def said_by_kiln(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["db", "upgrade"])
    assert result.exit_code == 1, result.output
    return " ".join(result.output.split())


def test_a_value_that_is_not_json_is_a_sentence_with_what_the_variable_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = said_by_kiln(monkeypatch, KILN_BATCH_DEADLINES="notjson")
    assert "KILN_BATCH_DEADLINES could not be read (Expecting value: line 1 column 1" in said
    takes = 'It takes: Per-model batch deadlines, by name or name:version (JSON: {"ocr": 600})'
    assert takes in said


def test_an_entry_of_a_json_value_is_named_inside_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    said = said_by_kiln(monkeypatch, KILN_BATCH_DEADLINES='{"ocr": "soon"}')
    assert "KILN_BATCH_DEADLINES (its 'ocr' entry)='soon': Input should be a valid number" in said


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("notaurl", "not a database URL; Kiln takes one like postgresql+psycopg://"),
        ("mysql://kiln@db/kiln", "Kiln runs on PostgreSQL or SQLite, not mysql"),
        ("postgresql+psycopg2://kiln@db/kiln", "Kiln reaches PostgreSQL through psycopg 3"),
        ("postgresql+psycopg://kiln@db:abc/kiln", "not a database URL"),  # the port
    ],
)
def test_a_database_url_kiln_cannot_use_is_a_sentence(
    monkeypatch: pytest.MonkeyPatch, url: str, why: str
) -> None:
    said = said_by_kiln(monkeypatch, KILN_DATABASE_URL=url)
    assert f"KILN_DATABASE_URL='{url}': {why}" in said


def test_a_refused_database_url_hides_its_password(monkeypatch: pytest.MonkeyPatch) -> None:
    said = said_by_kiln(monkeypatch, KILN_DATABASE_URL="mysql://kiln:hunter2@db/kiln")
    assert "hunter2" not in said and "KILN_DATABASE_URL='mysql://kiln:***@db/kiln'" in said


def test_a_hosting_providers_postgres_url_means_psycopg() -> None:
    from kiln.app.core.config import database_url

    for written in ("postgres://kiln:pw@db:5432/kiln", "postgresql://kiln:pw@db:5432/kiln"):
        assert database_url(written) == "postgresql+psycopg://kiln:pw@db:5432/kiln"
    socket = "postgres://kiln@/kiln?host=/var/run/postgresql"
    assert database_url(socket) == "postgresql+psycopg://kiln@/kiln?host=/var/run/postgresql"
    # every other URL stays as written: quoting, options, a path with any character
    for kept in (
        "postgresql+psycopg://kiln:p%40ss@db:5432/kiln?sslmode=require",
        "sqlite:////srv/kiln.db",
        "sqlite:////tmp/données/kiln.db",
        "sqlite:///:memory:",
    ):
        assert database_url(kept) == kept
