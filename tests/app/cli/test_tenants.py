"""`kiln keys create --bucket`, `kiln tenants …`: on the embedded SQLite database."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from kiln.app.db.models import ApiKey
from kiln.app.tenants.tenants import allowed_buckets


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The `kiln` command on the test's data dir (`settings` cleared every other KILN_*)."""
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    return CliRunner()


def buckets(sessions: sessionmaker[Session], tenant: str) -> set[str]:
    with sessions() as session:
        return allowed_buckets(session, tenant)


def test_keys_create_allows_its_buckets(kiln: CliRunner, sessions: sessionmaker[Session]) -> None:
    done = kiln.invoke(
        app, ["keys", "create", "--tenant", "acme", "--bucket", "photos", "--bucket", "scans"]
    )
    assert done.exit_code == 0, done.output
    assert "kiln_" in done.stdout
    assert buckets(sessions, "acme") == {"photos", "scans"}


def test_a_bad_bucket_creates_no_key(kiln: CliRunner, sessions: sessionmaker[Session]) -> None:
    done = kiln.invoke(app, ["keys", "create", "--tenant", "acme", "--bucket", "Not A Bucket"])
    assert done.exit_code == 1 and "is not a bucket name" in done.output
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(ApiKey)) == 0


def test_allow_deny_and_list(kiln: CliRunner, sessions: sessionmaker[Session]) -> None:
    assert kiln.invoke(app, ["keys", "create", "--tenant", "globex"]).exit_code == 0
    allowed = kiln.invoke(app, ["tenants", "allow-bucket", "acme", "photos"])
    assert allowed.exit_code == 0 and "tenant 'acme' may read bucket 'photos'" in allowed.stdout
    again = kiln.invoke(app, ["tenants", "allow-bucket", "acme", "photos"])
    assert again.exit_code == 0 and "(already)" in again.stdout
    listed = kiln.invoke(app, ["tenants", "list"], terminal_width=200)
    assert listed.exit_code == 0
    rows = {line.split()[1]: line for line in listed.stdout.splitlines() if "│" in line[:2]}
    assert "photos" in rows["acme"] and "(no S3 access)" in rows["globex"]
    denied = kiln.invoke(app, ["tenants", "deny-bucket", "acme", "photos"])
    assert denied.exit_code == 0 and "may no longer read" in denied.stdout
    assert buckets(sessions, "acme") == set()
    missing = kiln.invoke(app, ["tenants", "deny-bucket", "acme", "photos"])
    assert missing.exit_code == 1 and "has no bucket 'photos'" in missing.output
