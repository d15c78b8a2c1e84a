"""`kiln admin tenant set NAME --weight W` and `show`: on the embedded SQLite database."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from kiln.app.tenants.shares import weight_of


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    return CliRunner()


def test_set_and_show_a_tenant_s_weight(kiln: CliRunner, sessions: sessionmaker[Session]) -> None:
    shown = kiln.invoke(app, ["admin", "tenant", "show", "acme"])
    assert shown.exit_code == 0 and "fair-share weight 1" in shown.stdout
    done = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--weight", "2"])
    assert done.exit_code == 0, done.output
    assert "tenant 'acme': fair-share weight 2" in done.stdout
    with sessions() as session:
        assert weight_of(session, "acme") == 2.0
    assert "fair-share weight 2" in kiln.invoke(app, ["admin", "tenant", "show", "acme"]).stdout


def test_a_bad_weight_or_none_is_a_sentence(kiln: CliRunner) -> None:
    zero = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--weight", "0"])
    assert zero.exit_code == 1 and "weight must be above 0" in zero.output
    nothing = kiln.invoke(app, ["admin", "tenant", "set", "acme"])
    assert nothing.exit_code == 1 and "Name a setting to change" in nothing.output
