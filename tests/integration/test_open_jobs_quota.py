"""The open-jobs quota holds on Postgres when submissions race at the limit, and a refused
submission leaves no uploads behind."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

from devstack.images import solid
from kiln.app.core.config import Settings
from kiln.app.core.errors import LimitExceededError
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.app.storage.local import LocalStore

RACERS = 20


def test_twenty_submissions_at_the_limit_let_exactly_one_through(
    migrated: Settings, tmp_path: Path
) -> None:
    tenant = f"racer-{uuid.uuid4().hex[:8]}"
    most = 3
    engine = make_engine(migrated.database_url, pool_size=RACERS, max_overflow=0)
    sessions = make_session_factory(engine)
    store = LocalStore(tmp_path / "store")
    dispatcher = RecordingDispatcher()

    def submit() -> None:
        with sessions() as session:
            request = JobRequest(tenant, "detector", uploads=[Upload("a.png", solid((9, 9, 9)))])
            submit_job(session, store, dispatcher, migrated, request, most_open=most)

    for _ in range(most - 1):  # one slot left
        submit()
    start = threading.Barrier(RACERS)
    outcomes: list[str] = []

    def race() -> None:
        start.wait()
        try:
            submit()
            outcomes.append("accepted")
        except LimitExceededError:
            outcomes.append("refused")

    threads = [threading.Thread(target=race) for _ in range(RACERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    engine.dispose()

    assert sorted(outcomes) == ["accepted"] + ["refused"] * (RACERS - 1)
    # The refused submissions' uploads were removed: only the three accepted jobs' remain.
    assert len(list(store.list("jobs/"))) == most
