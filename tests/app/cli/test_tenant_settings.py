"""`kiln admin tenant set|show --retention`: on the embedded SQLite database."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from kiln.app.db.models import TenantSettings


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    monkeypatch.setenv("KILN_RETENTION_MAX", "30d")
    return CliRunner()


def kept(sessions: sessionmaker[Session], tenant: str) -> int | None:
    with sessions() as session:
        row = session.get(TenantSettings, tenant)
        return None if row is None else row.retention_s


def test_a_tenants_retention_is_set_shown_and_unset(
    kiln: CliRunner, sessions: sessionmaker[Session]
) -> None:
    done = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--retention", "7d"])
    assert done.exit_code == 0 and "results kept 7d" in done.stdout, done.output
    assert kept(sessions, "acme") == 7 * 86_400
    shown = kiln.invoke(app, ["admin", "tenant", "show", "acme"])
    assert "results kept 7d" in shown.stdout
    unset = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--retention", "none"])
    assert unset.exit_code == 0 and "the deployment's" in unset.stdout
    assert kept(sessions, "acme") is None


@pytest.mark.parametrize(
    ("asked", "why"),
    [("-3d", "longer than zero"), ("soon", "not a duration"), ("60d", "at most 30d")],
)
def test_a_bad_retention_is_refused_with_a_sentence(
    kiln: CliRunner, sessions: sessionmaker[Session], asked: str, why: str
) -> None:
    done = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--retention", asked])
    assert done.exit_code == 1 and why in " ".join(done.output.split()), done.output
    assert kept(sessions, "acme") is None
