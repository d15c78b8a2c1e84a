"""Replaying a job's failed items (`app/jobs/retry.py`) on SQLite, no worker: the copy, its
chunks, the links both ways, idempotency and the refusals."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db import counters
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.dispatch.contract import INTERACTIVE
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs import jobs, retry
from kiln.app.storage.local import LocalStore
from tests.app.conftest import CHUNK_SIZE

TEXTS = [f"text number {i}" for i in range(8)]


def submitted(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> Job:
    request = jobs.JobRequest(
        tenant="acme",
        model="text-embed",
        inputs=[jobs.InputRef(text=t) for t in TEXTS],
    )
    return jobs.submit_job(session, store, dispatcher, settings, request).job


def end(session: Session, job: Job, failed: list[int], cancelled: tuple[int, ...] = ()) -> None:
    """End the job as a worker would: the listed items (by position) failed or cancelled,
    the rest succeeded, counted; the job closed."""
    ids = list(session.scalars(select(Item.id).where(Item.job_id == job.id).order_by(Item.id)))
    now = utcnow()
    ended = {ids[i]: ItemStatus.FAILED for i in failed}
    ended |= {ids[i]: ItemStatus.CANCELLED for i in cancelled}
    for item_id in ids:
        status = ended.get(item_id, ItemStatus.SUCCEEDED)
        error = None if status == ItemStatus.SUCCEEDED else "Could not read it."
        session.execute(
            update(Item)
            .where(Item.id == item_id)
            .values(status=status, error=error, finished_at=now)
        )
    counters.add(
        session, job.id, 0, counters.ended(ended.get(i, ItemStatus.SUCCEEDED) for i in ids)
    )
    session.execute(
        update(Job).where(Job.id == job.id).values(status=JobStatus.COMPLETED, finished_at=now)
    )
    session.commit()
    session.expire_all()  # the factory keeps objects loaded across commits


def test_a_retry_runs_exactly_the_failed_items_chunked_and_linked_both_ways(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    sent = RecordingDispatcher()
    job = submitted(session, store, sent, settings)
    end(session, job, failed=[1, 4, 6, 7], cancelled=[2])
    sent.calls.clear()

    new = retry.retry_job(session, sent, settings, retry.RetryRequest("acme", job.id[:8])).job

    assert new.retry_of == job.id and new.model == job.model and new.queue == INTERACTIVE
    assert retry.retries_of(session, job.id) == [new.id]
    rows = session.execute(
        select(Item.key, Item.text, Item.status, Item.chunk)
        .where(Item.job_id == new.id)
        .order_by(Item.id)
    ).all()
    assert [r.text for r in rows] == [TEXTS[i] for i in (1, 4, 6, 7)]
    assert {r.status for r in rows} == {ItemStatus.PENDING}
    assert [r.chunk for r in rows] == [i // CHUNK_SIZE for i in range(4)]  # as a submission
    assert new.chunk_count == 2 and [c.chunk for c in sent.calls] == [0, 1]
    assert sum(len(c.item_ids) for c in sent.calls) == 4
    assert counters.read(session, new.id).total == 4

    with_cancelled = retry.RetryRequest("acme", job.id, include_cancelled=True)
    again = retry.retry_job(session, sent, settings, with_cancelled).job
    assert counters.read(session, again.id).total == 5
    assert retry.retries_of(session, job.id) == [new.id, again.id]


def test_the_same_key_answers_the_first_retry(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    sent = RecordingDispatcher()
    job = submitted(session, store, sent, settings)
    end(session, job, failed=[0])
    keyed = retry.RetryRequest("acme", job.id, idempotency_key="night-1")
    first = retry.retry_job(session, sent, settings, keyed)
    second = retry.retry_job(session, sent, settings, keyed)
    assert first.created and not second.created and second.job.id == first.job.id
    assert retry.retries_of(session, job.id) == [first.job.id]


def test_refusals_say_why(session: Session, store: LocalStore, settings: Settings) -> None:
    sent = RecordingDispatcher()
    job = submitted(session, store, sent, settings)
    with pytest.raises(ConflictError, match="still queued"):
        retry.retry_job(session, sent, settings, retry.RetryRequest("acme", job.id))
    end(session, job, failed=[], cancelled=[3])
    with pytest.raises(ConflictError, match="no failed items to retry"):
        retry.retry_job(session, sent, settings, retry.RetryRequest("acme", job.id))
    with pytest.raises(NotFoundError):
        retry.retry_job(session, sent, settings, retry.RetryRequest("globex", job.id))
    images = retry.RetryRequest("acme", job.id, include_cancelled=True, model="detector")
    with pytest.raises(InputError, match="takes images"):
        retry.retry_job(session, sent, settings, images)
    bad = retry.RetryRequest("acme", job.id, include_cancelled=True, options={"nope": 1})
    with pytest.raises(InputError):
        retry.retry_job(session, sent, settings, bad)
