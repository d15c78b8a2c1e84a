"""The courier on a migrated SQLite database with a stand-in for the network: a delivery's
body is built once and signed, a 2xx delivers it, a failure is retried on the schedule and
then given up, and a slow receiver holds one sender while the others go on."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks.webhooks import Webhook

from kiln.app.core.config import Settings
from kiln.app.db import webhooks as db
from kiln.app.db.models import Job, JobStatus, utcnow
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.tenants.webhook_secret import tenant_secret
from kiln.workers.webhooks.courier import Courier
from tests.support import migrated_settings

SECRET = "deployment-secret-for-tests-0123"


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(
        tmp_path, monkeypatch, webhook_secret=SECRET, webhook_allow_private=True,
        webhook_backoff_s=[0.05, 0.05], webhook_concurrency=4, webhook_sweep_s=0.05,
    )  # fmt: skip


@pytest.fixture
def sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(settings.database_url)
    yield make_session_factory(engine)
    engine.dispose()


class Receiver:
    """Answers as told per call; remembers what it was sent."""

    def __init__(self, answers: list[int | float]) -> None:
        self.answers = answers  # an int: that status; a float: sleep that long, then 200
        self.got: list[tuple[str, dict[str, str], str]] = []
        self.lock = threading.Lock()

    def __call__(self, _: httpx.Client, url: str, headers: dict[str, str], body: str) -> db.Outcome:
        with self.lock:
            answer = self.answers.pop(0) if self.answers else 200
            self.got.append((url, headers, body))
        if isinstance(answer, float):
            time.sleep(answer)
            answer = 200
        return db.Outcome(200 <= answer < 300, answer, None if answer < 300 else f"HTTP {answer}")


def _ended_jobs(sessions: sessionmaker[Session], n: int) -> list[str]:
    ids = []
    with sessions() as session:
        for i in range(n):
            job = Job(id=f"job-{i}", tenant="acme", model="phash", status=JobStatus.COMPLETED,
                      finished_at=utcnow(), notify={"url": f"http://127.0.0.1/{i}",
                      "events": ["completed"]})  # fmt: skip
            session.add(job)
            session.flush()
            db.record_end(session, job.id, "completed")
            ids.append(job.id)
        session.commit()
    return ids


def _wait_settled(sessions: sessionmaker[Session], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with sessions() as session:
            if db.pending_count(session) == 0:
                return
        time.sleep(0.02)
    raise AssertionError("deliveries still pending")


def _statuses(sessions: sessionmaker[Session], ids: list[str]) -> list[tuple[str, int]]:
    with sessions() as session:
        return [(d.status, d.attempts) for i in ids for d in db.deliveries_of(session, i)]


def test_deliveries_are_signed_retried_and_given_up(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ids = _ended_jobs(sessions, 3)
    # job-0: 200; job-1: 500 then 200; job-2: 500 three times (three attempts: gave up).
    receiver = Receiver([200, 500, 500, 500, 200, 500])
    courier = Courier(sessions, settings, send=receiver)
    try:
        courier.wake()
        _wait_settled(sessions)
    finally:
        courier.stop()

    assert sorted(_statuses(sessions, ids)) == [("delivered", 1), ("delivered", 2), ("gave_up", 3)]
    secret = tenant_secret(settings.webhook_secret, "acme")
    bodies: dict[str, set[str]] = {}
    for url, headers, body in receiver.got:
        event = Webhook(secret).verify(body, headers)  # raises unless signed by the tenant's key
        assert event["type"] == "job.completed" and url.endswith(event["data"]["id"][4:])
        bodies.setdefault(headers["webhook-id"], set()).add(body)
    assert all(len(sent) == 1 for sent in bodies.values())  # every retry sends the same body
    assert len(receiver.got) == 6


def test_a_slow_receiver_holds_one_sender_only(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ids = _ended_jobs(sessions, 6)
    receiver = Receiver([2.0])  # the first claimed answers after 2 s, the rest at once
    courier = Courier(sessions, settings, send=receiver)
    try:
        courier.wake()
        started = time.monotonic()
        deadline = started + 5
        while time.monotonic() < deadline:
            if sum(s == ("delivered", 1) for s in _statuses(sessions, ids)) >= 5:
                break
            time.sleep(0.02)
        others_done = time.monotonic() - started
        _wait_settled(sessions)
    finally:
        courier.stop()
    assert others_done < 1.5  # five delivered while the slow one was still waiting
    assert _statuses(sessions, ids) == [("delivered", 1)] * 6


def test_a_worker_that_cannot_sign_claims_no_delivery(
    settings: Settings, sessions: sessionmaker[Session]
) -> None:
    ids = _ended_jobs(sessions, 2)
    receiver = Receiver([])
    courier = Courier(sessions, settings.model_copy(update={"webhook_secret": None}), send=receiver)
    try:
        courier.wake()
        time.sleep(0.3)  # a few sweeps' worth: it must not have started claiming
    finally:
        courier.stop()
    assert receiver.got == []
    assert _statuses(sessions, ids) == [("pending", 0), ("pending", 0)]
