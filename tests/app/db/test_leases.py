"""Item leases: taking, renewing, losing and reclaiming them, on a migrated SQLite database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import event, update
from sqlalchemy.orm import Session

from kiln.app.db import counters, leases, queries
from kiln.app.db.models import Item, ItemStatus, JobStatus, utcnow
from tests.app.db.test_queries import items_of, make_job, result_row


def _ids(session: Session, job_id: str) -> list[int]:
    return [i.id for i in items_of(session, job_id)]


def _expire(session: Session, job_id: str) -> None:
    session.execute(
        update(Item)
        .where(Item.job_id == job_id)
        .values(lease_expires_at=utcnow() - timedelta(seconds=1))
    )
    session.commit()


def test_a_live_lease_is_not_taken_by_another_run(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING] * 2)
    ids = _ids(session, job.id)
    assert len(leases.take(session, job.id, ids, "run-a", 60)) == 2
    session.commit()

    assert leases.take(session, job.id, ids, "run-b", 60) == []
    assert leases.held_elsewhere(session, ids, "run-b")
    assert not leases.held_elsewhere(session, ids, "run-a")
    items = items_of(session, job.id)
    assert {i.lease_owner for i in items} == {"run-a"}
    assert all(i.lease_expires_at is not None for i in items)


def test_the_same_run_retaking_its_lease_succeeds(session: Session) -> None:
    """A Celery retry keeps the task id, so the retry gets its own items back."""
    job = make_job(session, [ItemStatus.PENDING])
    ids = _ids(session, job.id)
    leases.take(session, job.id, ids, "task-1", 60)
    assert [i.id for i in leases.take(session, job.id, ids, "task-1", 60)] == ids
    assert items_of(session, job.id)[0].attempts == 2


def test_an_expired_lease_is_taken_over_and_the_old_run_writes_nothing(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING])
    ids = _ids(session, job.id)
    leases.take(session, job.id, ids, "run-a", 60)
    session.commit()
    _expire(session, job.id)

    assert [i.id for i in leases.take(session, job.id, ids, "run-b", 60)] == ids
    assert leases.holds(session, job.id, "run-a") == 0
    assert leases.holds(session, job.id, "run-b") == 1
    assert not leases.holds_any(session, job.id, "run-a", ids)
    assert leases.holds_any(session, job.id, "run-b", ids)
    late = result_row("k0", ItemStatus.FAILED, error="From the stale run.", outputs=None)
    queries.upsert_results(session, job.id, 0, [late], owner="run-a")
    assert items_of(session, job.id)[0].status == ItemStatus.RUNNING
    queries.upsert_results(session, job.id, 0, [result_row("k0")], owner="run-b")
    session.commit()
    session.expire_all()
    assert items_of(session, job.id)[0].status == ItemStatus.SUCCEEDED


def test_renew_pushes_the_expiry_and_reports_the_job_status(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING], status=JobStatus.CANCELLING)
    ids = _ids(session, job.id)
    leases.take(session, job.id, ids, "run-a", 1)
    session.commit()
    before = items_of(session, job.id)[0].lease_expires_at
    held = leases.renew_many(session, ["run-a", "someone-else"], 600)
    statuses = leases.job_statuses(session, {job.id})
    session.commit()
    session.expire_all()
    after = items_of(session, job.id)[0].lease_expires_at
    assert held == {"run-a": 1}  # a run that holds nothing is missing from the answer
    assert statuses == {job.id: JobStatus.CANCELLING}
    assert before is not None and after is not None and after > before


def test_renew_leaves_a_lease_with_enough_left_and_still_counts_it(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    ids = _ids(session, job.id)
    leases.take(session, job.id, ids[:1], "run-a", 600)  # plenty left
    leases.take(session, job.id, ids[1:], "run-b", 10)  # running low
    session.commit()
    before = [item.lease_expires_at for item in items_of(session, job.id)]

    held = leases.renew_many(session, ["run-a", "run-b"], 600, keep_s=450)
    session.commit()
    session.expire_all()

    after = [item.lease_expires_at for item in items_of(session, job.id)]
    assert held == {"run-a": 1, "run-b": 1}
    assert after[0] == before[0]  # not rewritten
    assert after[1] is not None and before[1] is not None and after[1] > before[1]


def test_release_hands_items_back(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING])
    leases.take(session, job.id, _ids(session, job.id), "run-a", 60)
    assert leases.release(session, job.id, "run-a") == 1
    item = items_of(session, job.id)[0]
    assert (item.status, item.lease_owner) == (ItemStatus.PENDING, None)


def test_reset_expired_touches_only_open_jobs_with_lapsed_leases(session: Session) -> None:
    lapsed = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    live = make_job(session, [ItemStatus.PENDING])
    closed = make_job(session, [ItemStatus.RUNNING], status=JobStatus.CANCELLED)
    leases.take(session, lapsed.id, _ids(session, lapsed.id), "run-a", 60)
    leases.take(session, live.id, _ids(session, live.id), "run-b", 60)
    session.commit()
    _expire(session, lapsed.id)

    assert leases.reset_expired(session) == {(lapsed.id, 0)}
    session.commit()
    session.expire_all()
    assert {i.status for i in items_of(session, lapsed.id)} == {ItemStatus.PENDING}
    assert items_of(session, live.id)[0].status == ItemStatus.RUNNING
    assert items_of(session, closed.id)[0].status == ItemStatus.RUNNING
    stranded = leases.stranded_chunks(session, older_than_s=30)
    assert [(c.job_id, c.item_ids) for c in stranded] == [(lapsed.id, _ids(session, lapsed.id))]


def test_stranded_chunks_wait_out_the_grace_and_mark_sent_restarts_it(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.SUCCEEDED])
    session.execute(update(Item).values(queued_at=utcnow() - timedelta(seconds=120)))
    session.commit()

    stranded = leases.stranded_chunks(session, older_than_s=60)
    assert [(c.job_id, c.chunk, c.item_ids) for c in stranded] == [
        (job.id, 0, _ids(session, job.id)[:1])
    ]
    assert leases.stranded_chunks(session, older_than_s=600) == []
    leases.mark_sent(session, stranded[0].item_ids)
    session.commit()
    assert leases.stranded_chunks(session, older_than_s=60) == []


def test_release_keeps_what_stopped_the_run_and_may_not_charge_it(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING])
    ids = _ids(session, job.id)
    leases.take(session, job.id, ids, "run-a", 60)
    leases.release(session, job.id, "run-a", "Could not reach S3 for s3://out/x.")
    item = items_of(session, job.id)[0]
    assert (item.status, item.attempts, item.error) == (
        ItemStatus.PENDING, 1, "Could not reach S3 for s3://out/x."
    )  # fmt: skip
    leases.take(session, job.id, ids, "run-b", 60)
    leases.release(session, job.id, "run-b", "Kiln's storage bucket is missing.", charged=False)
    assert items_of(session, job.id)[0].attempts == 1  # Kiln's setup, not the item: not counted


LIMIT = 3


def take_chunk(session: Session, job_id: str, owner: str) -> leases.TakenChunk | None:
    taken = leases.take_chunk(session, job_id, 0, _ids(session, job_id), owner, 60, LIMIT)
    session.commit()
    return taken


def test_an_item_is_never_taken_past_the_limit_and_fails_with_the_last_error(
    session: Session,
) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    for run in range(LIMIT):
        taken = take_chunk(session, job.id, f"run-{run}")
        assert taken is not None and len(taken.items) == 2
        leases.release(session, job.id, f"run-{run}", f"Stopped by fault {run}.")
        session.commit()
    assert [i.attempts for i in items_of(session, job.id)] == [LIMIT, LIMIT]

    last = take_chunk(session, job.id, "run-last")
    assert last is not None and last.items == [] and not last.held_elsewhere
    items = items_of(session, job.id)
    assert [i.attempts for i in items] == [LIMIT, LIMIT]  # the limit, never past it
    assert {i.status for i in items} == {ItemStatus.FAILED}
    assert items[0].error == (
        f"{leases.gave_up(LIMIT)} The last error recorded: Stopped by fault {LIMIT - 1}."
    )
    tally = counters.read(session, job.id)
    assert (tally.failed, tally.open) == (2, 0)
    assert counters.difference(session, job.id) == counters.Tally()


def test_duplicate_runs_of_a_chunk_count_one_attempt_each_and_stop_at_the_limit(
    session: Session,
) -> None:
    """Copies of one chunk's message (the reconciler's, a redelivery) racing: only a copy that
    takes the items counts an attempt, so the limit holds however many copies run."""
    job = make_job(session, [ItemStatus.PENDING])
    for run in range(LIMIT * 3):
        taken = take_chunk(session, job.id, f"run-{run}")
        duplicate = take_chunk(session, job.id, f"copy-{run}")
        assert duplicate is not None and duplicate.items == []
        if taken is not None and taken.items:
            _expire(session, job.id)  # the run dies; its lease runs out
    item = items_of(session, job.id)[0]
    assert item.attempts == LIMIT and item.status == ItemStatus.FAILED
    assert item.error == leases.gave_up(LIMIT)  # no run recorded an error


def test_a_chunk_takes_its_fresh_items_and_fails_its_spent_ones_in_one_lease(
    session: Session,
) -> None:
    """`take` leaves an item at the limit alone and `give_up` fails it, on the items `take`
    did not take: the one leased now to its last attempt runs (its own lease is takeable)."""
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING, ItemStatus.PENDING])
    spent, last, fresh = items_of(session, job.id)
    spent.attempts, last.attempts = LIMIT, LIMIT - 1
    session.commit()
    taken = take_chunk(session, job.id, "run-a")
    assert taken is not None and [i.id for i in taken.items] == [last.id, fresh.id]
    by_id = {i.id: i for i in items_of(session, job.id)}
    assert (by_id[spent.id].status, by_id[spent.id].attempts) == (ItemStatus.FAILED, LIMIT)
    assert by_id[spent.id].error == leases.gave_up(LIMIT)
    assert (by_id[last.id].status, by_id[last.id].attempts) == (ItemStatus.RUNNING, LIMIT)
    assert (by_id[fresh.id].status, by_id[fresh.id].attempts) == (ItemStatus.RUNNING, 1)
    assert counters.read(session, job.id).failed == 1


def test_a_take_on_sqlite_finds_its_items_by_id_not_by_scanning_the_job(session: Session) -> None:
    """The job check is a check (`dialect.checked`): SQLite looks the chunk's ids up by
    primary key, so a chunk's take does not grow with its job (the plan scanned an index on
    `job_id`, every item of the job, per chunk)."""
    job = make_job(session, [ItemStatus.PENDING] * 3)
    ids = _ids(session, job.id)
    statements: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, sql: str, params: Any, *_rest: Any) -> None:
        if sql.startswith("UPDATE items"):
            statements.append((sql, params))

    engine = session.get_bind()
    event.listen(engine, "before_cursor_execute", seen)
    try:
        assert [i.id for i in leases.take(session, job.id, ids[:2], "run-a", 60)] == ids[:2]
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    (sql, params), *_ = statements
    explained = session.connection().exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)
    plan = [row[3] for row in explained]
    assert not any("USING INDEX" in step for step in plan), plan
    assert any("INTEGER PRIMARY KEY" in step for step in plan), plan
    session.rollback()
