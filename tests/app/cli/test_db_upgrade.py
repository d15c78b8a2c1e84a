"""`kiln db upgrade` says what it did: from which revision to which, or that there was nothing
to do (on the embedded SQLite database; on Postgres in tests/integration/test_setup.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import get_settings
from kiln.app.db import migrate
from kiln.app.db.session import make_engine


def flat(output: str) -> str:
    return " ".join(output.split())


@pytest.fixture
def kiln(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in [n for n in os.environ if n.upper().startswith("KILN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path / "data"))
    return CliRunner()


def test_a_fresh_database_then_an_up_to_date_one(kiln: CliRunner, tmp_path: Path) -> None:
    where = get_settings(data_dir=tmp_path / "data").database_url
    head = migrate.describe(migrate.head())
    count = len(list(migrate.scripts().walk_revisions()))

    fresh = kiln.invoke(app, ["db", "upgrade"])
    assert fresh.exit_code == 0, fresh.output
    assert flat(fresh.output) == (
        f"Upgraded the database at {where} from empty to {head}: {count} migrations applied."
    )
    again = kiln.invoke(app, ["db", "upgrade"])
    assert again.exit_code == 0, again.output
    assert flat(again.output) == f"The database at {where} is already at {head}; nothing to do."


def test_a_database_one_release_behind(kiln: CliRunner, tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path / "data")
    newest = migrate.scripts().get_revision(migrate.head())
    assert newest is not None and isinstance(newest.down_revision, str)
    migrate.upgrade(settings, newest.down_revision)
    answer = kiln.invoke(app, ["db", "upgrade"])
    assert answer.exit_code == 0, answer.output
    assert flat(answer.output).endswith(
        f"from {migrate.describe(newest.down_revision)} to {migrate.describe(migrate.head())}: "
        "1 migration applied."
    )


def test_a_database_a_newer_release_upgraded_is_left_alone(kiln: CliRunner, tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path / "data")
    migrate.upgrade(settings)
    engine = make_engine(settings.database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    answer = kiln.invoke(app, ["db", "upgrade"])
    assert answer.exit_code == 1
    assert "The database is at revision 9999, which this Kiln does not know" in flat(answer.output)


def test_a_database_that_cannot_be_reached_is_one_sentence(
    kiln: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:1/kiln")
    answer = kiln.invoke(app, ["db", "upgrade"])
    assert answer.exit_code == 1
    assert flat(answer.output).startswith(
        "error: The database at postgresql+psycopg://postgres@127.0.0.1:1/kiln cannot be reached:"
    )
    assert "Traceback" not in answer.output
