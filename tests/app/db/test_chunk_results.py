"""What a chunk run reads before it writes (`chunk_results.earlier_results`), on a migrated
SQLite database: nothing once its lease was taken over, else the chunk's items it did not run."""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from kiln.app.db import leases
from kiln.app.db.chunk_results import earlier_results
from kiln.app.db.models import Item, ItemStatus
from tests.app.db.test_queries import items_of, make_job


def test_the_chunks_items_finished_outside_the_run(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.SUCCEEDED, ItemStatus.CANCELLED])
    first = items_of(session, job.id)[0].id
    leases.take(session, job.id, [first], "run-a", 60)

    earlier = earlier_results(session, job.id, 0, "run-a", {first: "k0"}, whole=False)
    assert [i.key for i in earlier or []] == ["k1", "k2"]
    assert earlier_results(session, job.id, 0, "run-a", {first: "k0"}, whole=True) == []


def test_a_run_whose_lease_was_taken_over_gets_none(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING])
    first = items_of(session, job.id)[0].id
    leases.take(session, job.id, [first], "run-a", 60)
    session.execute(update(Item).where(Item.job_id == job.id).values(lease_owner="run-b"))

    assert earlier_results(session, job.id, 0, "run-a", {first: "k0"}, whole=True) is None
    assert earlier_results(session, job.id, 0, "run-b", {first: "k0"}, whole=True) == []


def test_a_run_with_no_rows_of_its_own_is_not_asked_for_its_lease(session: Session) -> None:
    """Its videos became frames: it holds no item, and still writes the chunk's shard."""
    job = make_job(session, [ItemStatus.SUCCEEDED])
    assert [i.key for i in earlier_results(session, job.id, 0, "run-a", {}, False) or []] == ["k0"]
