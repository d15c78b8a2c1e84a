"""`kiln admin tenant set|show`: a tenant's default webhook, checked as a job's is, on the
embedded SQLite database; and the job that names none takes it."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.cli.remote import notify_request
from kiln.app.core.config import Settings
from kiln.app.db.models import TenantSettings
from kiln.app.jobs.webhooks import job_notify


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    return CliRunner()


def _row(sessions: sessionmaker[Session], tenant: str) -> TenantSettings | None:
    with sessions() as session:
        return session.get(TenantSettings, tenant)


def test_set_show_and_clear_the_default_webhook(
    kiln: CliRunner, sessions: sessionmaker[Session]
) -> None:
    url = "https://93.184.215.14/kiln"
    done = kiln.invoke(
        app, ["admin", "tenant", "set", "acme", "--notify", url, "--notify-events", "failed"],
        terminal_width=200,
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    assert url in done.stdout and "failed" in done.stdout
    row = _row(sessions, "acme")
    assert row is not None and (row.notify_url, row.notify_events) == (url, ["failed"])
    with sessions() as session:  # a job of the tenant that names no webhook takes it
        assert job_notify(session, "acme", None) == {"url": url, "events": ["failed"]}
        assert job_notify(session, "globex", None) is None

    shown = kiln.invoke(app, ["admin", "tenant", "show", "acme"], terminal_width=200)
    assert shown.exit_code == 0 and url in shown.stdout

    cleared = kiln.invoke(app, ["admin", "tenant", "set", "acme", "--notify", ""])
    assert cleared.exit_code == 0, cleared.output
    row = _row(sessions, "acme")
    assert row is not None and row.notify_url is None


@pytest.mark.parametrize(
    ("args", "sentence"),
    [
        (["--notify", "http://127.0.0.1:9000/x"], "KILN_WEBHOOK_ALLOW_PRIVATE"),
        (["--notify", "ftp://example.com/x"], "http:// or https://"),
        (["--notify-events", "expired"], "Webhook events are"),
    ],
)
def test_a_bad_default_is_refused_with_a_sentence(
    kiln: CliRunner, sessions: sessionmaker[Session], args: list[str], sentence: str
) -> None:
    done = kiln.invoke(app, ["admin", "tenant", "set", "acme", *args], terminal_width=200)
    assert done.exit_code == 1 and sentence in done.output
    assert _row(sessions, "acme") is None


def test_submit_s_notify_options() -> None:
    assert notify_request(None, None) is None
    assert notify_request("https://e.example/h", "cancelled,completed") == {
        "url": "https://e.example/h",
        "events": ["completed", "cancelled"],
    }
    assert notify_request("https://e.example/h", None)["events"] == [  # type: ignore[index]
        "completed", "failed", "cancelled",
    ]  # fmt: skip


def test_status_prints_each_delivery(capsys: pytest.CaptureFixture[str]) -> None:
    from kiln.app.cli.remote import _print_deliveries

    delivery = {
        "id": "d-1",
        "event": "completed",
        "status": "pending",
        "attempts": 2,
        "last_status": 500,
        "last_error": "The receiver answered HTTP 500: oops",
        "next_attempt_at": "2026-11-29T04:30:00+00:00",
    }
    hook = {"url": "https://e.example/h", "events": ["completed", "failed"]}
    _print_deliveries({**hook, "deliveries": [delivery]})
    out = capsys.readouterr().out
    assert "webhook https://e.example/h (completed, failed)" in out
    assert "completed: pending after 2 attempt(s), id d-1, last HTTP 500" in out
    assert "The receiver answered HTTP 500: oops" in out
