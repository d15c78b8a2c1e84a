"""Deliveries on a migrated SQLite database: recorded by the statement that ends a job, only
for the events it asked for and never twice; claimed with a lease; recorded once per attempt."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.db import queries
from kiln.app.db import webhooks as db
from kiln.app.db.failures import fail_job
from kiln.app.db.models import ItemStatus, Job, JobStatus, WebhookDelivery, utcnow
from tests.app.db.test_queries import make_job

HOOK = "https://hooks.example/kiln"


def _job(session: Session, events: list[str] | None, statuses: list[str]) -> Job:
    job = make_job(session, statuses)
    if events is not None:
        job.notify = {"url": HOOK, "events": events}
        session.commit()
    return job


def _rows(session: Session, job_id: str) -> list[WebhookDelivery]:
    return db.deliveries_of(session, job_id)


def test_the_close_records_the_event_the_job_asked_for(session: Session) -> None:
    job = _job(session, ["completed", "failed"], [ItemStatus.SUCCEEDED])
    finished = queries.finish_job_if_done(session, job.id)
    session.commit()

    assert finished is not None and finished.status == JobStatus.COMPLETED
    [row] = _rows(session, job.id)
    assert (row.event, row.url, row.status, row.attempts) == ("completed", HOOK, "pending", 0)
    assert row.payload["type"] == "job.completed" and row.tenant == "acme"
    assert row.next_attempt_at is not None  # due now


def test_no_row_for_an_event_not_asked_for_or_a_job_without_a_webhook(session: Session) -> None:
    quiet = _job(session, ["failed"], [ItemStatus.SUCCEEDED])
    none = _job(session, None, [ItemStatus.SUCCEEDED])
    for job in (quiet, none):
        assert queries.finish_job_if_done(session, job.id) is not None
    session.commit()
    assert _rows(session, quiet.id) == [] and _rows(session, none.id) == []


def test_a_failed_job_records_its_failed_event(session: Session) -> None:
    job = _job(session, ["failed"], [ItemStatus.PENDING])
    assert fail_job(session, job.id, "The output refuses every write.")
    session.commit()
    assert [r.event for r in _rows(session, job.id)] == ["failed"]


def test_a_cancelled_job_records_its_cancelled_event(session: Session) -> None:
    job = _job(session, ["cancelled"], [ItemStatus.SUCCEEDED, ItemStatus.PENDING])
    job.status = JobStatus.CANCELLING
    queries.cancel_items(session, job.id)
    session.flush()
    assert queries.finish_job_if_done(session, job.id) is not None
    session.commit()
    assert [r.event for r in _rows(session, job.id)] == ["cancelled"]


def test_an_event_is_recorded_once(session: Session) -> None:
    job = _job(session, ["completed"], [])
    db.record_end(session, job.id, "completed")
    db.record_end(session, job.id, "completed")  # a replayed close: insert-or-ignore
    session.commit()
    assert len(_rows(session, job.id)) == 1


def test_a_claim_is_a_lease_and_fences_a_late_sender(session: Session) -> None:
    job = _job(session, ["completed"], [])
    db.record_end(session, job.id, "completed")
    session.commit()

    [first] = db.claim_due(session, 10, lease_s=60)
    session.commit()
    assert first.attempt == 1 and first.url == HOOK
    assert db.claim_due(session, 10, lease_s=60) == []  # leased: nobody else takes it

    # The sender dies; its lease runs out; another claims the row (attempt 2).
    session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))
    [second] = db.claim_due(session, 10, lease_s=60)
    session.commit()
    assert (second.id, second.attempt) == (first.id, 2)

    assert not db.record_attempt(session, first, db.Outcome(True, 200))  # the dead one's
    assert db.record_attempt(session, second, db.Outcome(True, 204))
    session.commit()
    [row] = _rows(session, job.id)
    assert (row.status, row.attempts, row.last_status) == ("delivered", 2, 204)
    assert row.delivered_at is not None


def test_a_failed_attempt_waits_then_gives_up(session: Session) -> None:
    job = _job(session, ["completed"], [])
    db.record_end(session, job.id, "completed")
    session.commit()
    [claimed] = db.claim_due(session, 1, lease_s=60)
    later = utcnow() + timedelta(seconds=300)
    db.record_attempt(session, claimed, db.Outcome(False, 500, "HTTP 500", later))
    session.commit()
    assert db.claim_due(session, 1, lease_s=60) == []  # not due before its retry time
    row = session.scalars(select(WebhookDelivery)).one()
    assert (row.status, row.last_status, row.last_error) == ("pending", 500, "HTTP 500")

    row.next_attempt_at = utcnow() - timedelta(seconds=1)
    session.commit()
    [again] = db.claim_due(session, 1, lease_s=60)
    db.record_attempt(session, again, db.Outcome(False, None, "refused", None))
    session.commit()
    session.refresh(row)
    assert (row.status, row.attempts) == ("gave_up", 2)
    assert db.pending_count(session) == 0
