"""`fail_job`: a job whose output refuses every write ends at once, on a migrated SQLite
database: its open items fail with the reason, counted; its listing ends; it frees its
pipeline; and a second call changes nothing."""

from __future__ import annotations

from sqlalchemy.orm import Session

from kiln.app.db import counters, leases
from kiln.app.db.failures import fail_job
from kiln.app.db.models import Ingest, ItemStatus, Job, JobStatus, Pipeline
from kiln.app.jobs.ingest import running_job
from tests.app.db.test_ingest import bulk_job
from tests.app.db.test_queries import items_of, make_job

REASON = "The output bucket 'results' does not exist (s3://results/x/): create it."


def test_a_failed_job_ends_every_open_item_with_the_reason(session: Session) -> None:
    statuses = [ItemStatus.SUCCEEDED, ItemStatus.PENDING, ItemStatus.PENDING, ItemStatus.FAILED]
    job = make_job(session, statuses)
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids[1:2], "run-a", 60)  # one running under a live lease
    session.commit()

    assert fail_job(session, job.id, REASON)
    session.commit()

    items = items_of(session, job.id)
    assert [i.status for i in items] == [ItemStatus.SUCCEEDED] + [ItemStatus.FAILED] * 3
    assert [i.error for i in items[1:3]] == [REASON, REASON]
    assert all(i.lease_owner is None and i.finished_at is not None for i in items[1:3])
    assert leases.holds(session, job.id, "run-a") == 0  # the run finds its items gone
    failed = session.get(Job, job.id)
    assert failed is not None
    assert (failed.status, failed.error) == (JobStatus.FAILED, REASON)
    assert failed.finished_at is not None and failed.started_at is not None
    tally = counters.read(session, job.id)
    assert (tally.total, tally.succeeded, tally.failed, tally.open) == (4, 1, 3, 0)
    assert counters.difference(session, job.id) == counters.Tally()  # the counters agree


def test_a_failed_bulk_job_stops_listing_and_frees_its_pipeline(session: Session) -> None:
    pipeline = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://p/"}, model="phash")
    session.add(pipeline)
    session.flush()
    job = bulk_job(session, [ItemStatus.PENDING], pipeline_id=pipeline.id)
    assert running_job(session, pipeline.id) == job.id

    assert fail_job(session, job.id, REASON)
    session.commit()

    ingest = session.get(Ingest, job.id)
    assert ingest is not None and ingest.done
    assert running_job(session, pipeline.id) is None  # a new run may start


def test_failing_an_ended_job_changes_nothing_but_its_stragglers(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    assert fail_job(session, job.id, REASON)
    session.commit()
    assert not fail_job(session, job.id, "Another reason.")  # failed already: the first stands
    session.commit()
    failed = session.get(Job, job.id)
    assert failed is not None and failed.error == REASON

    completed = make_job(session, [ItemStatus.SUCCEEDED], status=JobStatus.COMPLETED)
    assert not fail_job(session, completed.id, REASON)
    session.commit()
    done = session.get(Job, completed.id)
    assert done is not None and (done.status, done.error) == (JobStatus.COMPLETED, None)
    assert [i.status for i in items_of(session, completed.id)] == [ItemStatus.SUCCEEDED]


def test_items_still_open_in_a_job_failed_already_end_too(session: Session) -> None:
    """A job whose listing failed while a run held some items: the run's write fails too, and
    its items end with the output's reason rather than stay open in a closed job."""
    job = make_job(session, [ItemStatus.RUNNING], status=JobStatus.FAILED)
    assert not fail_job(session, job.id, REASON)
    session.commit()
    item = items_of(session, job.id)[0]
    assert (item.status, item.error) == (ItemStatus.FAILED, REASON)
    assert counters.read(session, job.id).open == 0
