"""Retention (`app/jobs/retention.py`, `app/db/retention.py`, the sweep in
`workers/jobs/retention.py`) on SQLite and a local store: durations and their bounds, when a job
expires, and the sweep deleting an expired job's results and items in bounded, resumable ticks
while keeping its summary."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings, get_settings
from kiln.app.core.durations import parse_duration
from kiln.app.core.errors import ConflictError, InputError, OutputError
from kiln.app.db.models import Item, Job, JobCounter, TenantSettings, aware, utcnow
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs import jobs, retention
from kiln.app.results import results
from kiln.app.storage import ObjectStore
from kiln.app.storage.local import LocalStore
from kiln.workers.jobs import retention as sweeper
from tests.app.jobs.test_retry import end


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("30m", 1800), ("12h", 43_200), ("7d", 604_800), ("2W", 1_209_600)],
)
def test_durations_read_as_people_write_them(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("asked", "why"),
    [
        (-5, "longer than zero"),
        ("-1d", "longer than zero"),
        (0, "longer than zero"),
        ("0h", "longer than zero"),
        ("a week", "not a duration"),
        ("31d", "at most 30d"),
    ],
)
def test_a_bad_expires_after_is_refused_with_a_sentence(asked: int | str, why: str) -> None:
    settings = Settings(retention_max="30d")
    with pytest.raises(InputError, match=why) as refused:
        retention.check_retention(asked, settings)
    assert str(refused.value).endswith(".")


def test_the_operators_settings_read_durations_and_keep_the_default_within_the_max() -> None:
    assert Settings(retention="7d", retention_max="30d").retention == 604_800
    assert Settings(retention="none").retention is None
    with pytest.raises(ValueError, match="longer than KILN_RETENTION_MAX"):
        Settings(retention="60d", retention_max="30d")
    with pytest.raises(ValueError, match="longer than zero"):
        Settings(retention="0")


@dataclass
class Runtime:
    """What the sweep uses of a worker's runtime."""

    settings: Settings
    sessions: sessionmaker[Session]
    store: ObjectStore

    def place(self, job_id: str, output: str | None) -> results.Place:
        return results.place_for(self.store, job_id, output, lambda: None)


def a_finished_job(
    session: Session, store: LocalStore, settings: Settings, retention_s: int | None = None
) -> Job:
    request = jobs.JobRequest(
        tenant="acme",
        model="text-embed",
        inputs=[jobs.InputRef(text=f"t{i}") for i in range(8)],
        retention_s=retention_s,
    )
    job = jobs.submit_job(session, store, RecordingDispatcher(), settings, request).job
    end(session, job, failed=[2])
    place = results.place_for(store, job.id, None, lambda: None)
    for chunk in range(3):
        place.store.put(results.shard_key(place, chunk), b"shard")
    place.store.put(results.manifest_key(place), b"{}")
    return job


def objects(store: LocalStore, job: Job) -> list[str]:
    return list(store.list(results.results_prefix(job.id)))


def test_expiry_comes_from_the_job_then_its_tenant_then_the_deployment(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    own = a_finished_job(session, store, settings, retention_s=3600)
    plain = a_finished_job(session, store, settings)
    deployment = settings.model_copy(update={"retention": 86_400})
    assert retention.expires_at(session, settings, plain) is None  # kept for ever
    assert retention.expires_at(session, deployment, plain) == aware(plain.finished_at) + timedelta(
        days=1
    )
    session.add(TenantSettings(tenant="acme", retention_s=7200))
    session.commit()
    assert retention.expires_at(session, deployment, plain) == aware(plain.finished_at) + timedelta(
        hours=2
    )
    assert retention.expires_at(session, deployment, own) == aware(own.finished_at) + timedelta(
        hours=1
    )


def test_the_sweep_stamps_then_deletes_results_and_items_in_bounded_resumable_ticks(
    sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    with sessions() as session:
        expiring = a_finished_job(session, store, settings, retention_s=60)
        kept = a_finished_job(session, store, settings)  # no retention anywhere: kept
        session.refresh(expiring)
        session.refresh(kept)
        session.expunge_all()  # their ids, read below
    small = settings.model_copy(update={"retention_sweep_rows": 5})
    runtime = Runtime(small, sessions, store)

    first = sweeper.sweep(runtime)  # stamps the expiry; nothing is due yet
    assert first["expiries_set"] == 1 and first["jobs_expired"] == 0
    with sessions() as session:
        stamped = session.get(Job, expiring.id)
        assert stamped is not None and stamped.expires_at is not None
        session.execute(  # an hour later, as far as the sweep can tell
            update(Job)
            .where(Job.id == expiring.id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()

    second = sweeper.sweep(runtime)  # the budget (5 rows) stops it half way
    assert second["jobs_expired"] == 0 and second["expired_rows"] == 5
    assert objects(store, expiring) == []
    with sessions() as session:
        job = session.get(Job, expiring.id)
        assert job is not None and job.expired_at is None and job.summary is not None
        with pytest.raises(ConflictError, match="deleted by retention"):
            retention.check_not_expired(job)

    third = sweeper.sweep(runtime)
    assert third["jobs_expired"] == 1 and third["expired_rows"] == 3
    with sessions() as session:
        job = session.get(Job, expiring.id)
        assert job is not None and job.expired_at is not None
        left = session.scalar(select(func.count()).where(Item.job_id == expiring.id))
        counters = session.scalar(select(func.count()).where(JobCounter.job_id == expiring.id))
        assert (left, counters) == (0, 0)
        summary = retention.summary_counts(job)
        assert summary is not None and (summary.total, summary.succeeded, summary.failed) == (
            8,
            7,
            1,
        )
        assert job.summary is not None and job.summary["output"].endswith(f"results/{job.id}/")
        assert session.scalar(select(func.count()).where(Item.job_id == kept.id)) == 8
    assert len(objects(store, kept)) == 4

    assert sweeper.sweep(runtime)["jobs_expired"] == 0  # nothing left to do


def test_the_deployment_default_applies_when_set(tmp_path: Path) -> None:
    assert get_settings(data_dir=tmp_path, retention="1h").retention == 3600


class GoneBucket:
    """A user's output bucket that no longer lets Kiln in."""

    def list(self, prefix: str) -> list[str]:
        raise OutputError("The output bucket 'results' does not exist (s3://results/x/).")

    def describe(self, key: str) -> str:
        return f"s3://results/x/{key}"


@dataclass
class OutputGone(Runtime):
    def place(self, job_id: str, output: str | None) -> results.Place:
        return results.Place(GoneBucket(), f"x/{job_id}/")  # type: ignore[arg-type]


def test_an_output_bucket_that_is_gone_leaves_its_results_said_and_the_rows_still_go(
    sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    with sessions() as session:
        job = a_finished_job(session, store, settings, retention_s=60)
        session.execute(
            update(Job).where(Job.id == job.id).values(expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()
        job_id = job.id
    assert sweeper.sweep(OutputGone(settings, sessions, store))["jobs_expired"] == 1
    with sessions() as session:
        swept = session.get(Job, job_id)
        assert swept is not None and swept.expired_at is not None and swept.summary is not None
        assert "does not exist" in swept.summary["results_left"]
        assert session.scalar(select(func.count()).where(Item.job_id == job_id)) == 0


def test_without_a_maximum_a_retention_is_still_at_most_ten_years() -> None:
    with pytest.raises(InputError, match="at most 3650d; leave it out to keep them"):
        retention.check_retention(10**30, Settings())
    with pytest.raises(ValueError, match="at most 3650d"):
        Settings(retention="3651d")
