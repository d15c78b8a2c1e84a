"""`kiln db recount`: a job's kept counters against its items, on the embedded SQLite database."""

from __future__ import annotations

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from devstack.images import solid
from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from kiln.app.db import counters
from kiln.app.db.models import JobCounter
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.app.storage.local import LocalStore


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    return CliRunner()


def job(sessions: sessionmaker[Session], store: LocalStore, settings: Settings) -> str:
    uploads = [Upload(f"{i}.png", solid((i, i, i))) for i in range(3)]
    with sessions() as session:
        request = JobRequest("acme", "detector", uploads=uploads)
        return submit_job(session, store, RecordingDispatcher(), settings, request).job.id


def test_recount_finds_drift_and_fixes_it(
    kiln: CliRunner, sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    kept, drifted = job(sessions, store, settings), job(sessions, store, settings)
    with sessions() as session:  # as if a write had bypassed the counters
        session.execute(update(JobCounter).where(JobCounter.job_id == drifted).values(total=7))
        session.commit()

    found = kiln.invoke(app, ["db", "recount"])
    assert found.exit_code == 1, found.output
    assert drifted in found.output and kept not in found.output
    assert "2 jobs checked, 1 differ" in found.output

    fixed = kiln.invoke(app, ["db", "recount", drifted, "--fix"])
    assert fixed.exit_code == 0, fixed.output
    with sessions() as session:
        assert counters.read(session, drifted) == counters.recount(session, drifted)
        assert counters.read(session, drifted).total == 3
    assert kiln.invoke(app, ["db", "recount"]).exit_code == 0
