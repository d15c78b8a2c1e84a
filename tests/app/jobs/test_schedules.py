"""Schedules: adding and removing them, and `run_due` starting each due run as one unit of work
whose ingest message follows its commit."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db.models import Ingest, Job, JobStatus, Schedule, utcnow
from kiln.app.dispatch.stub import BrokenDispatcher, IngestStep, RecordingDispatcher
from kiln.app.jobs import job_lookup
from kiln.app.jobs.ingest import Source
from kiln.app.jobs.schedules import (
    ScheduleRequest,
    add_schedule,
    check_cron,
    remove_schedule,
    run_due,
)
from kiln.app.tenants.tenants import allow_bucket

NIGHTLY = ScheduleRequest("acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash")


@pytest.fixture(autouse=True)
def _nightly(session: Session) -> None:
    allow_bucket(session, "acme", "photos")
    add_schedule(session, NIGHTLY)


def schedule_of(sessions: sessionmaker[Session], name: str = "nightly") -> Schedule:
    """The schedule as committed (read on a session of its own)."""
    with sessions() as other:
        found = other.scalar(select(Schedule).where(Schedule.name == name))
    assert found is not None
    return found


def next_run(sessions: sessionmaker[Session], name: str = "nightly") -> datetime:
    return schedule_of(sessions, name).next_run_at.replace(tzinfo=None)


def job_count(sessions: sessionmaker[Session]) -> int:
    with sessions() as other:
        return int(other.scalar(select(func.count()).select_from(Job)) or 0)


def later(days: int) -> datetime:
    return utcnow() + timedelta(days=days)


def test_a_due_schedule_starts_one_run_and_waits_for_its_next_time(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    dispatcher = RecordingDispatcher()
    due = later(2)
    started = run_due(session, dispatcher, now=due)
    assert len(started) == 1
    assert dispatcher.ingests == [IngestStep(started[0], None, 0)]
    schedule = schedule_of(sessions)
    assert schedule.last_job_id == started[0]
    assert schedule.next_run_at.replace(tzinfo=None) > due.replace(tzinfo=None)
    assert run_due(session, dispatcher, now=due) == []  # not due again until its next time
    assert job_count(sessions) == 1


def test_the_ingest_message_follows_the_commit(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    """When the message is sent, another session already sees the job, its ingest state and
    the schedule advanced: a worker taking the message at once finds them."""
    due = later(2)
    seen: list[tuple[bool, bool, datetime]] = []

    class Checking(RecordingDispatcher):
        def enqueue_ingest(self, job_id: str, owner: str | None = None, countdown: float = 0):
            with sessions() as other:
                seen.append(
                    (
                        other.get(Job, job_id) is not None,
                        other.get(Ingest, job_id) is not None,
                        next_run(sessions),
                    )
                )
            super().enqueue_ingest(job_id, owner, countdown)

    assert len(run_due(session, Checking(), now=due)) == 1
    ((job_seen, ingest_seen, advanced),) = seen
    assert job_seen and ingest_seen and advanced > due.replace(tzinfo=None)


def test_a_run_still_going_skips_the_next_time(
    session: Session, sessions: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    dispatcher = RecordingDispatcher()
    (first,) = run_due(session, dispatcher, now=later(2))
    due = later(4)
    with caplog.at_level(logging.WARNING, logger="kiln.app.jobs.schedules"):
        assert run_due(session, dispatcher, now=due) == []
    assert "skipped" in caplog.text and "still running" in caplog.text
    assert next_run(sessions) > due.replace(tzinfo=None)
    assert schedule_of(sessions).last_job_id == first
    assert job_count(sessions) == 1 and len(dispatcher.ingests) == 1


def test_due_schedules_start_in_the_order_they_fell_due(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    late = ScheduleRequest(**{**NIGHTLY.__dict__, "name": "late", "cron": "30 2 * * *"})
    add_schedule(session, late)
    dispatcher = RecordingDispatcher()
    started = run_due(session, dispatcher, now=later(2))
    assert [i.job_id for i in dispatcher.ingests] == started
    assert [schedule_of(sessions, name).last_job_id for name in ("nightly", "late")] == started


def test_nothing_runs_before_it_is_due(session: Session, sessions: sessionmaker[Session]) -> None:
    before = next_run(sessions)
    assert run_due(session, RecordingDispatcher(), now=utcnow()) == []
    assert next_run(sessions) == before and job_count(sessions) == 0


def test_a_refused_send_fails_the_run_and_still_advances(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    due = later(2)
    with pytest.raises(TransientError, match="could not be queued"):
        run_due(session, BrokenDispatcher(), now=due)
    with sessions() as other:
        (job,) = other.scalars(select(Job))
        assert job.status == JobStatus.FAILED and job.error == "Kiln could not reach its queue."
    assert next_run(sessions) > due.replace(tzinfo=None)


def test_names_are_unique_per_tenant_and_removal_is_committed(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    with pytest.raises(ConflictError, match="already a schedule named 'nightly'"):
        add_schedule(session, NIGHTLY)
    remove_schedule(session, "acme", "nightly")
    with sessions() as other:
        assert other.scalar(select(func.count()).select_from(Schedule)) == 0
    with pytest.raises(NotFoundError, match="no schedule 'nightly'"):
        remove_schedule(session, "acme", "nightly")


def test_a_schedule_keeps_its_options_for_every_run(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    remove_schedule(session, "acme", "nightly")
    add_schedule(session, ScheduleRequest(**{**NIGHTLY.__dict__, "options": {"max_distance": 6}}))
    assert schedule_of(sessions).options == {"max_distance": 6}
    (job_id,) = run_due(session, RecordingDispatcher(), now=later(2))
    with sessions() as other:
        job = other.get(Job, job_id)
        assert job is not None and job.options == {"max_distance": 6}


def test_a_schedule_asked_to_retry_failures_retries_them_on_every_run(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    remove_schedule(session, "acme", "nightly")
    add_schedule(session, ScheduleRequest(**{**NIGHTLY.__dict__, "retry_failed": True}))
    assert schedule_of(sessions).retry_failed
    (job_id,) = run_due(session, RecordingDispatcher(), now=later(2))
    with sessions() as other:
        ingest = other.get(Ingest, job_id)
        assert ingest is not None and ingest.retry_failed


@pytest.mark.parametrize(
    ("options", "sentence"),
    [
        ({"max_distnace": 6}, "has no option 'max_distnace'"),
        ({"max_distance": 99}, "from 0 to 16"),
    ],
)
def test_a_schedule_with_bad_options_is_refused_when_added(
    session: Session, sessions: sessionmaker[Session], options: dict[str, object], sentence: str
) -> None:
    request = ScheduleRequest(**{**NIGHTLY.__dict__, "name": "other", "options": options})
    with pytest.raises(InputError, match=sentence):
        add_schedule(session, request)
    with sessions() as other:
        assert other.scalar(select(Schedule).where(Schedule.name == "other")) is None


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("@daily", "@daily"),
        ("@Hourly", "@hourly"),
        ("@weekly", "@weekly"),
        ("@monthly", "@monthly"),
        ("@yearly", "@yearly"),
        ("@annually", "@annually"),
        ("0 2 * * *", "0 2 * * *"),
        (" 30  4 1 * mon ", "30 4 1 * mon"),
        ("*/15 * * * *", "*/15 * * * *"),
    ],
)
def test_a_cron_expression_or_a_shorthand_is_taken(given: str, stored: str) -> None:
    assert check_cron(given) == stored


WHAT = (
    "A cron expression is five fields, minute hour day-of-month month weekday, in UTC "
    "(e.g. '0 2 * * *': 02:00 every day), or one of @hourly, @daily, @weekly, @monthly, @yearly."
)


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("0 2 * *", "'0 2 * *' has 4 fields, not five."),
        ("0 2 * * * *", "'0 2 * * * *' has 6 fields, not five."),
        ("", "'' has 0 fields, not five."),
        ("daily", "'daily' has 1 field, not five."),
        ("@reboot", "'@reboot' is not a cron expression Kiln knows."),
        (
            "61 * * * *",
            "'61 * * * *' is not a cron expression: a field is out of range (minute 0-59, "
            "hour 0-23, day 1-31, month 1-12, weekday 0-6 or sun-sat).",
        ),
        (
            "a b c d e",
            "'a b c d e' is not a cron expression: a field is not a number, a name, a range "
            "(1-5), a list (1,3), a step (*/15) or *.",
        ),
    ],
)
def test_a_cron_that_is_not_one_says_what_one_is(given: str, why: str) -> None:
    with pytest.raises(InputError) as raised:
        check_cron(given)
    assert str(raised.value) == f"{why} {WHAT}"


def test_a_daily_schedule_runs_at_the_next_midnight_utc(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    add_schedule(session, ScheduleRequest(**{**NIGHTLY.__dict__, "name": "d", "cron": "@daily"}))
    schedule = schedule_of(sessions, "d")
    assert schedule.cron == "@daily"
    when = schedule.next_run_at.replace(tzinfo=None)
    now = utcnow().replace(tzinfo=None)
    assert (when.hour, when.minute, when.second) == (0, 0, 0)
    assert timedelta(0) < when - now <= timedelta(days=1)


def test_a_scheduled_run_names_its_schedule_and_pipeline(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    (job_id,) = run_due(session, RecordingDispatcher(), now=later(2))
    with sessions() as other:
        job = other.get(Job, job_id)
        assert job is not None and job.schedule == "nightly"
        assert job_lookup.pipeline_name(other, job) == "nightly"
