"""The bucket allow-list: its functions, and every service path that takes an s3:// URI."""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.core.errors import ForbiddenError, InputError, NotFoundError
from kiln.app.db.models import Job, Schedule, utcnow
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.jobs.jobs import InputRef, JobRequest, submit_job
from kiln.app.jobs.schedules import ScheduleRequest, add_schedule, run_due
from kiln.app.storage.local import LocalStore
from kiln.app.tenants.auth import create_key, revoke_key
from kiln.app.tenants.tenants import (
    allow_bucket,
    allowed_buckets,
    bucket_of,
    check_bucket,
    deny_bucket,
    list_tenants,
)

SENTENCE = (
    "Tenant 'acme' may not read bucket 'photos'; an operator can allow it with "
    "`kiln tenants allow-bucket acme photos`."
)


def test_an_empty_list_allows_no_bucket(session: Session) -> None:
    assert allowed_buckets(session, "acme") == set()
    with pytest.raises(ForbiddenError) as error:
        check_bucket(session, "acme", "s3://photos/cat.jpg")
    assert str(error.value) == SENTENCE


def test_allow_and_deny(session: Session) -> None:
    assert allow_bucket(session, "acme", "photos")
    assert not allow_bucket(session, "acme", "s3://photos/any/prefix")  # already there
    check_bucket(session, "acme", "s3://photos/cat.jpg")
    check_bucket(session, "acme", "photos")
    with pytest.raises(ForbiddenError, match="'globex' may not read bucket 'photos'"):
        check_bucket(session, "globex", "s3://photos/cat.jpg")  # lists are per tenant
    deny_bucket(session, "acme", "photos")
    with pytest.raises(ForbiddenError):
        check_bucket(session, "acme", "s3://photos/cat.jpg")
    with pytest.raises(NotFoundError, match="has no bucket 'photos'"):
        deny_bucket(session, "acme", "photos")


@pytest.mark.parametrize("name", ["", "a", "Has-Upper", "-dash", "sp ace", "x" * 300])
def test_bucket_names_are_checked(session: Session, name: str) -> None:
    with pytest.raises(InputError, match="is not a bucket name"):
        allow_bucket(session, "acme", name)


def test_bucket_of_a_uri_or_a_name() -> None:
    assert bucket_of("s3://photos/2026/a.jpg") == bucket_of("photos") == "photos"
    with pytest.raises(InputError, match="not an S3 URI"):
        bucket_of("https://photos/a.jpg")


def test_list_tenants_shows_keys_and_buckets(session: Session) -> None:
    create_key(session, "acme")
    revoked = create_key(session, "acme")
    revoke_key(session, revoked.prefix)
    create_key(session, "initech")
    allow_bucket(session, "acme", "photos")
    allow_bucket(session, "acme", "archive")
    allow_bucket(session, "globex", "scans")
    listed = {t.tenant: (t.active_keys, t.buckets) for t in list_tenants(session)}
    assert listed == {
        "acme": (1, ("archive", "photos")),
        "globex": (0, ("scans",)),
        "initech": (1, ()),
    }


def test_job_inputs_need_an_allowed_bucket(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest("acme", "detector", inputs=[InputRef(uri="s3://photos/a.jpg")])
    with pytest.raises(ForbiddenError, match="may not read bucket 'photos'"):
        submit_job(session, store, dispatcher, settings, request)
    assert dispatcher.calls == []
    allow_bucket(session, "acme", "photos")
    assert submit_job(session, store, dispatcher, settings, request).created


def test_one_input_in_a_denied_bucket_refuses_the_job(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    allow_bucket(session, "acme", "photos")
    inputs = [InputRef(uri="s3://photos/a.jpg"), InputRef(uri="s3://secrets/b.jpg")]
    with pytest.raises(ForbiddenError, match="bucket 'secrets'"):
        submit_job(
            session, store, dispatcher, settings, JobRequest("acme", "detector", inputs=inputs)
        )


def test_a_bad_request_is_a_422_before_any_bucket_is_judged(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    twice = [InputRef(uri="s3://photos/a.jpg"), InputRef(uri="s3://photos/a.jpg")]
    with pytest.raises(InputError, match="share the name"):
        submit_job(
            session, store, dispatcher, settings, JobRequest("acme", "detector", inputs=twice)
        )
    local = [InputRef(uri="file:///etc/passwd")]
    with pytest.raises(InputError, match="not an S3 URI"):
        submit_job(
            session, store, dispatcher, settings, JobRequest("acme", "detector", inputs=local)
        )


def test_kiln_run_local_files_need_no_bucket(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    """`kiln run` (the operator on their own machine) reads file:// inputs: no list applies."""
    request = JobRequest(
        "local", "detector", inputs=[InputRef(uri="file:///photos/a.jpg")], local_files=True
    )
    assert submit_job(session, store, dispatcher, settings, request).created


def test_uploads_need_no_bucket(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    from tests.app.jobs.test_jobs import uploads

    request = JobRequest("newcomer", "detector", uploads=uploads(1))
    assert submit_job(session, store, dispatcher, settings, request).created


@pytest.mark.parametrize(
    ("source", "output", "denied"),
    [
        ("s3://photos/2026/", None, "photos"),
        ("s3://allowed/2026/", "s3://elsewhere/results/", "elsewhere"),
    ],
)
def test_bulk_source_and_output_need_allowed_buckets(
    session: Session, source: str, output: str | None, denied: str
) -> None:
    allow_bucket(session, "acme", "allowed")
    ingests = RecordingDispatcher()
    request = BulkRequest("acme", "phash", Source(source), output=output)
    with pytest.raises(ForbiddenError, match=f"bucket '{denied}'"):
        submit_bulk(session, ingests, request)
    assert ingests.ingests == []
    allow_bucket(session, "acme", denied)
    assert submit_bulk(session, ingests, request).created


def test_a_schedule_needs_allowed_buckets(session: Session) -> None:
    request = ScheduleRequest("acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash")
    with pytest.raises(ForbiddenError, match="bucket 'photos'"):
        add_schedule(session, request)
    allow_bucket(session, "acme", "photos")
    session.commit()
    with pytest.raises(ForbiddenError, match="bucket 'out'"):
        add_schedule(session, ScheduleRequest(**{**request.__dict__, "output": "s3://out/r/"}))
    assert add_schedule(session, request).name == "nightly"


def test_a_schedule_whose_bucket_was_denied_skips_its_runs(
    session: Session, caplog: pytest.LogCaptureFixture
) -> None:
    allow_bucket(session, "acme", "photos")
    session.commit()
    add_schedule(
        session, ScheduleRequest("acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash")
    )
    deny_bucket(session, "acme", "photos")
    session.commit()
    due = utcnow() + timedelta(days=2)
    with caplog.at_level(logging.WARNING, logger="kiln.app.jobs.schedules"):
        assert run_due(session, RecordingDispatcher(), now=due) == []
    assert "may not read bucket 'photos'" in caplog.text
    assert session.scalar(select(func.count()).select_from(Job)) == 0
    schedule = session.scalar(select(Schedule))
    assert schedule is not None and schedule.next_run_at.replace(tzinfo=due.tzinfo) > due
