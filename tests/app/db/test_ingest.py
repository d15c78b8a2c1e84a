"""The bulk-job queries (app/db/ingest.py) on a migrated SQLite database: the ingest claim, a
page's items and chunks, and a pipeline's memory of the objects it has seen and done."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.app.db import ingest
from kiln.app.db.ingest import Listed
from kiln.app.db.models import (
    Ingest,
    ItemStatus,
    Job,
    JobStatus,
    Pipeline,
    PipelineObject,
    utcnow,
)
from tests.app.db.test_queries import items_of, make_job

STALE_S = 60.0


def bulk_job(
    session: Session,
    statuses: list[str] | None = None,
    *,
    status: str = JobStatus.RUNNING,
    created_at: datetime | None = None,
    pipeline_id: int | None = None,
    **ingest_fields: object,
) -> Job:
    """A job with an ingest row (its fields as given) and one item per status."""
    job = make_job(session, statuses or [], status=status, created_at=created_at)
    job.pipeline_id = pipeline_id
    session.add(Ingest(job_id=job.id, **ingest_fields))
    session.commit()
    return job


def ingest_row(session: Session, job_id: str) -> Ingest:
    session.expire_all()
    row = session.get(Ingest, job_id)
    assert row is not None
    return row


def pipeline(session: Session) -> int:
    row = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://photos/"}, model="phash")
    session.add(row)
    session.commit()
    return row.id


def listed(*pairs: str) -> list[Listed]:
    """`listed("a=1", "b=2")`: objects `a` (ETag 1) and `b` (ETag 2)."""
    return [Listed(*pair.split("=")) for pair in pairs]


# --- the claim ----------------------------------------------------------------------------


def test_a_free_ingest_is_claimed_and_its_heartbeat_set(session: Session) -> None:
    job = bulk_job(session)
    claimed = ingest.claim(session, job.id, "step-a", STALE_S)
    session.commit()

    assert claimed is not None and claimed.owner == "step-a"
    row = ingest_row(session, job.id)
    assert row.owner == "step-a" and row.heartbeat_at is not None


def test_a_live_claim_refuses_another_step_but_not_its_owner(session: Session) -> None:
    job = bulk_job(session, owner="step-a", heartbeat_at=utcnow())

    assert ingest.claim(session, job.id, "step-b", STALE_S) is None
    again = ingest.claim(session, job.id, "step-a", STALE_S)  # its own successor message
    assert again is not None and again.owner == "step-a"


def test_a_silent_claim_is_taken_over(session: Session) -> None:
    job = bulk_job(session, owner="step-a", heartbeat_at=utcnow() - timedelta(seconds=2 * STALE_S))

    taken = ingest.claim(session, job.id, "step-b", STALE_S)
    session.commit()

    assert taken is not None and taken.owner == "step-b"
    assert ingest.still_owner(session, job.id, "step-a") is None
    assert ingest.still_owner(session, job.id, "step-b") is not None


def test_a_finished_ingest_is_claimed_by_nobody(session: Session) -> None:
    job = bulk_job(session, done=True)
    assert ingest.claim(session, job.id, "step-a", STALE_S) is None
    assert ingest.still_owner(session, job.id, "step-a") is None


def test_listing_lasts_until_the_ingest_is_done(session: Session) -> None:
    job = bulk_job(session)
    assert ingest.listing(session, job.id)
    ingest_row(session, job.id).done = True
    session.commit()
    assert not ingest.listing(session, job.id)
    assert not ingest.listing(session, make_job(session).id)  # not a bulk job


# --- items and chunks ---------------------------------------------------------------------


def test_a_page_becomes_items_in_chunks_after_the_last_one(session: Session) -> None:
    job = bulk_job(session)
    page = listed("a.jpg=1", "b.jpg=2", "c.jpg=3", "d.jpg=4", "e.jpg=5")

    assert ingest.insert_items(session, job.id, "photos", page, first_chunk=2, size=2) == 3
    session.commit()

    items = items_of(session, job.id)
    assert [(i.key, i.chunk, i.etag) for i in items] == [
        ("a.jpg", 2, "1"), ("b.jpg", 2, "2"), ("c.jpg", 3, "3"), ("d.jpg", 3, "4"),
        ("e.jpg", 4, "5"),
    ]  # fmt: skip
    assert items[0].source == "s3://photos/a.jpg"
    assert {(i.status, i.attempts) for i in items} == {(ItemStatus.PENDING, 0)}


def test_a_page_listed_again_adds_no_item(session: Session) -> None:
    """A step that dies after its page committed but before the cursor moved lists it again."""
    job = bulk_job(session)
    ingest.insert_items(session, job.id, "photos", listed("a.jpg=1"), 0, 2)
    ingest.insert_items(session, job.id, "photos", listed("a.jpg=1", "b.jpg=2"), 0, 2)
    session.commit()
    assert [i.key for i in items_of(session, job.id)] == ["a.jpg", "b.jpg"]


def test_an_empty_page_fills_no_chunk(session: Session) -> None:
    job = bulk_job(session)
    assert ingest.insert_items(session, job.id, "photos", [], 0, 2) == 0
    assert items_of(session, job.id) == []


def test_outstanding_chunks_count_chunks_with_open_items(session: Session) -> None:
    job = bulk_job(session)
    ingest.insert_items(session, job.id, "photos", listed("a=1", "b=2", "c=3", "d=4"), 0, 1)
    session.commit()
    items = items_of(session, job.id)
    items[0].status = ItemStatus.SUCCEEDED
    items[1].status = ItemStatus.RUNNING
    session.commit()

    assert ingest.outstanding_chunks(session, job.id) == 3  # chunks 1, 2, 3


# --- a pipeline's objects -----------------------------------------------------------------


def _seen(session: Session, pipeline_id: int) -> dict[str, tuple[str, str | None, str | None]]:
    session.expire_all()
    rows = session.scalars(select(PipelineObject).where(PipelineObject.pipeline_id == pipeline_id))
    return {o.key: (o.etag, o.done_etag, o.done_model) for o in rows}


def _run(
    session: Session,
    pipeline_id: int,
    page: list[Listed],
    model: str,
    *,
    failing: frozenset[str] = frozenset(),
    retry_failed: bool = False,
) -> list[str]:
    """One pipeline run over `page`: the keys it processes (those in `failing` fail for their
    input's sake, the rest succeed)."""
    job = bulk_job(session, pipeline_id=pipeline_id)
    fresh = ingest.changed_objects(session, pipeline_id, job.id, model, page, retry_failed).fresh
    ingest.insert_items(session, job.id, "photos", fresh, 0, 10)
    keys = [o.key for o in fresh]
    ingest.mark_done(session, pipeline_id, job.id, model, [k for k in keys if k not in failing])
    ingest.mark_failed(session, pipeline_id, job.id, model, [k for k in keys if k in failing])
    session.commit()
    return keys


def _sorted(session: Session, pipeline_id: int, page: list[Listed], model: str) -> ingest.Sorted:
    """How a run over `page` sorts it (the run processes nothing)."""
    job = bulk_job(session, pipeline_id=pipeline_id)
    found = ingest.changed_objects(session, pipeline_id, job.id, model, page)
    session.commit()
    return found


def test_a_first_run_processes_everything_and_remembers_it(session: Session) -> None:
    pid = pipeline(session)
    assert _run(session, pid, listed("a=1", "b=2"), "phash:1") == ["a", "b"]
    assert _seen(session, pid) == {"a": ("1", "1", "phash:1"), "b": ("2", "2", "phash:1")}


def test_a_rerun_processes_only_new_and_changed_objects(session: Session) -> None:
    pid = pipeline(session)
    _run(session, pid, listed("a=1", "b=2"), "phash:1")

    assert _run(session, pid, listed("a=1", "b=changed", "c=3"), "phash:1") == ["b", "c"]
    assert _seen(session, pid)["b"] == ("changed", "changed", "phash:1")


def test_a_new_model_version_processes_everything_again(session: Session) -> None:
    pid = pipeline(session)
    _run(session, pid, listed("a=1"), "phash:1")
    assert _run(session, pid, listed("a=1"), "phash:2") == ["a"]


def test_an_object_that_failed_is_tried_again(session: Session) -> None:
    pid = pipeline(session)
    job = bulk_job(session, pipeline_id=pid)
    ingest.changed_objects(session, pid, job.id, "phash:1", listed("a=1"))
    session.commit()  # listed, never marked done nor failed (Kiln gave up on it, say)

    assert _run(session, pid, listed("a=1"), "phash:1") == ["a"]


def test_an_input_that_failed_is_kept_as_a_known_failure(session: Session) -> None:
    pid = pipeline(session)
    assert _run(session, pid, listed("a=1", "bad=2"), "phash:1", failing=frozenset({"bad"}))

    found = _sorted(session, pid, listed("a=1", "bad=2", "c=3"), "phash:1")
    assert ([o.key for o in found.fresh], found.unchanged, found.known_failed) == (["c"], 1, 1)


def test_a_known_failure_runs_again_when_asked_or_when_it_or_the_model_changed(
    session: Session,
) -> None:
    pid = pipeline(session)
    bad = frozenset({"bad"})
    _run(session, pid, listed("bad=1"), "phash:1", failing=bad)

    assert _run(session, pid, listed("bad=1"), "phash:1", failing=bad, retry_failed=True) == ["bad"]
    assert _run(session, pid, listed("bad=1"), "phash:2", failing=bad) == ["bad"]  # new model
    assert _run(session, pid, listed("bad=2"), "phash:1", failing=bad) == ["bad"]  # new bytes
    assert _run(session, pid, listed("bad=2"), "phash:1") == []  # known again, at its new ETag


def test_a_known_failure_that_succeeds_is_forgotten(session: Session) -> None:
    pid = pipeline(session)
    _run(session, pid, listed("a=1"), "phash:1", failing=frozenset({"a"}))
    assert _run(session, pid, listed("a=1"), "phash:1", retry_failed=True) == ["a"]  # fixed

    found = _sorted(session, pid, listed("a=1"), "phash:1")
    assert (found.fresh, found.unchanged, found.known_failed) == ([], 1, 0)
    row = session.scalars(select(PipelineObject)).one()
    assert (row.failed_etag, row.failed_model) == (None, None)


def test_objects_a_run_did_not_see_are_forgotten_as_deleted(session: Session) -> None:
    pid = pipeline(session)
    _run(session, pid, listed("a=1", "b=2", "c=3"), "phash:1")
    job = bulk_job(session, pipeline_id=pid)
    ingest.changed_objects(session, pid, job.id, "phash:1", listed("b=2"))

    gone = ingest.forget_unseen(session, pid, job.id)
    session.commit()

    assert sorted(gone) == ["a", "c"]
    assert list(_seen(session, pid)) == ["b"]


# --- stalled ingests (the reconciler) -----------------------------------------------------


def test_stalled_ingests_are_open_jobs_whose_step_went_silent(session: Session) -> None:
    long_ago = utcnow() - timedelta(seconds=2 * STALE_S)
    silent = bulk_job(session, owner="dead", heartbeat_at=long_ago)
    never_started = bulk_job(session, created_at=long_ago)
    bulk_job(session, owner="live", heartbeat_at=utcnow())
    bulk_job(session)  # just submitted: its first step has not run yet
    bulk_job(session, heartbeat_at=long_ago, done=True)
    bulk_job(session, heartbeat_at=long_ago, status=JobStatus.CANCELLED)

    assert sorted(ingest.stalled_ingests(session, STALE_S)) == sorted([silent.id, never_started.id])
