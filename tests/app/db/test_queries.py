"""The small query functions over jobs and items, on a migrated SQLite database."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.db import counters, leases, queries
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, Pipeline, aware, utcnow
from kiln.app.db.session import unit_of_work


def make_job(
    session: Session,
    statuses: Sequence[str] = (),
    *,
    tenant: str = "acme",
    status: str = JobStatus.RUNNING,
    created_at: datetime | None = None,
    job_id: str | None = None,
) -> Job:
    """A job with one item per status, keys `k0`, `k1`, ... in id order."""
    job = Job(
        id=job_id or str(uuid.uuid4()),
        tenant=tenant,
        model="detector",
        status=status,
        created_at=created_at or utcnow(),
    )
    session.add(job)
    session.flush()
    session.add_all(
        Item(job_id=job.id, key=f"k{i}", source=f"store:x/{i}", status=s)
        for i, s in enumerate(statuses)
    )
    session.flush()
    counters.repair(session, job.id)  # as if the items got there through Kiln's own writes
    session.commit()
    return job


def items_of(session: Session, job_id: str) -> list[Item]:
    session.expire_all()
    return list(session.scalars(select(Item).where(Item.job_id == job_id).order_by(Item.id)))


def snapshot(session: Session, job_id: str) -> list[tuple[Any, ...]]:
    return [
        (i.id, i.key, i.chunk, i.status, i.error, i.outputs, i.duration_ms, i.attempts)
        for i in items_of(session, job_id)
    ]


def result_row(key: str, status: str = ItemStatus.SUCCEEDED, **extra: Any) -> tuple[Any, ...]:
    """One item's result as `upsert_results` takes it (values in `RESULT_COLUMNS` order)."""
    row = {
        "key": key,
        "status": status,
        "error": None,
        "outputs": {"labels": [{"label": "cat", "score": 0.9}]},
        "duration_ms": 12.5,
    }
    row |= extra
    return tuple(row.get(name) for name in queries.RESULT_COLUMNS)


# --- job_counts ---------------------------------------------------------------------------


def test_job_counts_read_the_counters_of_the_job(session: Session) -> None:
    job = make_job(
        session,
        [
            ItemStatus.PENDING,
            ItemStatus.RUNNING,
            ItemStatus.SUCCEEDED,
            ItemStatus.SUCCEEDED,
            ItemStatus.FAILED,
            ItemStatus.CANCELLED,
        ],
    )
    make_job(session, [ItemStatus.SUCCEEDED] * 3)  # another job's items do not count

    counts = queries.job_counts(session, job.id)

    assert counts == queries.Counts(total=6, succeeded=2, failed=1, pending=2, cancelled=1)
    assert counts.done == 4


def test_job_counts_follow_the_items_as_they_change(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING] * 3)
    assert queries.job_counts(session, job.id) == queries.Counts(total=3, pending=3)
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids[:2], "run-1", 60)
    assert queries.job_counts(session, job.id) == queries.Counts(total=3, pending=3)  # running
    failed = result_row("k0", ItemStatus.FAILED, error="Bad.", outputs=None)
    queries.upsert_results(session, job.id, 0, [failed], "run-1")
    session.commit()
    assert queries.job_counts(session, job.id) == queries.Counts(total=3, failed=1, pending=2)
    queries.upsert_results(session, job.id, 0, [failed], "run-1")  # a replay counts nothing
    queries.cancel_items(session, job.id)  # k2, still pending; k1 runs on
    session.commit()
    counts = queries.job_counts(session, job.id)
    assert counts == queries.Counts(total=3, failed=1, pending=1, cancelled=1)
    assert counters.recount(session, job.id) == counters.read(session, job.id)


def test_job_counts_of_an_unknown_job_are_zero(session: Session) -> None:
    assert queries.job_counts(session, "nope") == queries.Counts()


# --- lease_items --------------------------------------------------------------------------


def test_lease_items_skips_finished_items_and_counts_attempts(session: Session) -> None:
    job = make_job(
        session,
        [
            ItemStatus.PENDING,
            ItemStatus.RUNNING,  # a redelivered chunk re-leases an expired lease
            ItemStatus.SUCCEEDED,
            ItemStatus.FAILED,
            ItemStatus.CANCELLED,
        ],
    )
    ids = [i.id for i in items_of(session, job.id)]

    leased = leases.take(session, job.id, ids, "run-1", 60)
    session.commit()

    assert [i.id for i in leased] == ids[:2]
    items = items_of(session, job.id)
    assert [i.status for i in items] == [
        ItemStatus.RUNNING,
        ItemStatus.RUNNING,
        ItemStatus.SUCCEEDED,
        ItemStatus.FAILED,
        ItemStatus.CANCELLED,
    ]
    assert [i.attempts for i in items] == [1, 1, 0, 0, 0]
    assert all(i.started_at is not None for i in items[:2])
    assert all(i.started_at is None for i in items[2:])


def test_leasing_again_increments_attempts(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    leases.take(session, job.id, ids, "run-1", 60)
    session.commit()
    assert [i.attempts for i in items_of(session, job.id)] == [2, 2]


def test_lease_items_takes_only_the_chunks_ids_of_that_job(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING] * 3)
    other = make_job(session, [ItemStatus.PENDING])
    ids = [i.id for i in items_of(session, job.id)]
    other_id = items_of(session, other.id)[0].id

    leased = leases.take(session, job.id, [ids[0], ids[2], other_id], "run-1", 60)
    session.commit()

    assert [i.id for i in leased] == [ids[0], ids[2]]
    assert [i.status for i in items_of(session, job.id)] == [
        ItemStatus.RUNNING,
        ItemStatus.PENDING,
        ItemStatus.RUNNING,
    ]
    assert items_of(session, other.id)[0].status == ItemStatus.PENDING


def test_lease_items_of_a_finished_chunk_is_empty(session: Session) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED, ItemStatus.CANCELLED])
    ids = [i.id for i in items_of(session, job.id)]
    assert leases.take(session, job.id, ids, "run-1", 60) == []


def test_mark_job_running_only_moves_a_queued_job(session: Session) -> None:
    queued = make_job(session, [ItemStatus.PENDING], status=JobStatus.QUEUED)
    cancelling = make_job(session, [ItemStatus.RUNNING], status=JobStatus.CANCELLING)
    queries.mark_job_running(session, queued.id)
    queries.mark_job_running(session, cancelling.id)
    session.commit()
    session.expire_all()
    assert session.get(Job, queued.id).status == JobStatus.RUNNING  # type: ignore[union-attr]
    assert session.get(Job, queued.id).started_at is not None  # type: ignore[union-attr]
    assert session.get(Job, cancelling.id).status == JobStatus.CANCELLING  # type: ignore[union-attr]


# --- upsert_results -----------------------------------------------------------------------


def test_upsert_results_writes_the_chunk(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    queries.upsert_results(
        session,
        job.id,
        0,
        [result_row("k0"), result_row("k1", ItemStatus.FAILED, error="Bad.", outputs=None)],
    )
    session.commit()

    items = items_of(session, job.id)
    assert [i.id for i in items] == ids  # updated in place, not inserted
    assert [(i.status, i.error) for i in items] == [
        (ItemStatus.SUCCEEDED, None),
        (ItemStatus.FAILED, "Bad."),
    ]
    assert items[0].outputs == {"labels": [{"label": "cat", "score": 0.9}]}
    assert items[0].duration_ms == 12.5
    assert all(i.finished_at is not None for i in items)
    assert [i.attempts for i in items] == [1, 1]


def test_upsert_results_is_part_of_its_unit_of_work(session: Session) -> None:
    """A unit that fails after the results statement leaves nothing behind: the results and
    their counters commit together or not at all (on SQLite the statement opens with WITH,
    before which Python's sqlite3 opens no transaction of its own)."""
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    session.commit()

    with pytest.raises(RuntimeError), unit_of_work(session):
        queries.upsert_results(session, job.id, 0, [result_row("k0"), result_row("k1")], "run-1")
        raise RuntimeError("the worker died before the commit")

    session.expire_all()
    assert {i.status for i in items_of(session, job.id)} == {ItemStatus.RUNNING}
    assert counters.read(session, job.id).succeeded == 0


def test_upsert_results_twice_changes_nothing(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING] * 3)
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    rows = [result_row("k0"), result_row("k1"), result_row("k2", ItemStatus.FAILED, error="X.")]
    queries.upsert_results(session, job.id, 0, rows)
    session.commit()
    first = snapshot(session, job.id)

    queries.upsert_results(session, job.id, 0, rows)  # the replay of a redelivered chunk
    session.commit()
    assert snapshot(session, job.id) == first

    changed = [result_row(k, ItemStatus.FAILED, error="Later.") for k in ("k0", "k1", "k2")]
    queries.upsert_results(session, job.id, 0, changed)  # a late, different answer
    session.commit()
    assert snapshot(session, job.id) == first


def test_upsert_results_never_overwrites_a_cancelled_item(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING, ItemStatus.PENDING])
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids[:1], "run-1", 60)
    queries.cancel_items(session, job.id)  # k1 was still pending
    session.commit()

    queries.upsert_results(session, job.id, 0, [result_row("k0"), result_row("k1")])
    session.commit()

    items = items_of(session, job.id)
    assert [i.status for i in items] == [ItemStatus.SUCCEEDED, ItemStatus.CANCELLED]
    assert items[1].error == "The job was cancelled."
    assert items[1].outputs is None


def test_upsert_results_writes_every_column_of_each_row(session: Session) -> None:
    """Each row's values land on its own item (the outputs travel apart from the rest on
    SQLite, joined back by position): set and null outputs and stages alike."""
    job = make_job(session, [ItemStatus.PENDING] * 3)
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    stages = {"fetch": 1.5, "decode": 2.0, "engine": 3.25, "post": 0.5}
    rows = [
        result_row("k0", sha256="a" * 64, answered_by="m:1", stages_ms=stages),
        result_row("k1", ItemStatus.FAILED, error="bad", outputs=None, fallback_reason="x"),
        result_row("k2", outputs={"labels": [{"label": "dog", "score": 0.25}]}, duration_ms=7.0),
    ]
    queries.upsert_results(session, job.id, 0, rows, "run-1")
    session.commit()
    session.expire_all()
    items = items_of(session, job.id)
    assert [(i.key, i.status, i.error) for i in items] == [
        ("k0", ItemStatus.SUCCEEDED, None),
        ("k1", ItemStatus.FAILED, "bad"),
        ("k2", ItemStatus.SUCCEEDED, None),
    ]
    assert [i.outputs for i in items] == [rows[0][3], None, rows[2][3]]
    assert [i.duration_ms for i in items] == [12.5, 12.5, 7.0]
    assert [i.stages_ms for i in items] == [stages, None, None]
    assert [(i.sha256, i.answered_by, i.fallback_reason) for i in items] == [
        ("a" * 64, "m:1", None),
        (None, None, "x"),
        (None, None, None),
    ]


def test_upsert_results_of_a_chunk_with_no_errors_nulls_them_all(session: Session) -> None:
    """On SQLite a column null in every row of the chunk is not read out of the rows (a flag
    says so): it is still written, as nulls, over what an earlier attempt left."""
    job = make_job(session, [ItemStatus.PENDING] * 2)
    ids = [i.id for i in items_of(session, job.id)]
    leases.take(session, job.id, ids, "run-1", 60)
    for item in items_of(session, job.id):
        item.error, item.fallback_reason, item.stages_ms = "stale", "old", {"fetch": 1.0}
    session.commit()
    queries.upsert_results(session, job.id, 0, [result_row("k0"), result_row("k1")], "run-1")
    session.commit()
    session.expire_all()
    items = items_of(session, job.id)
    assert [(i.status, i.error, i.fallback_reason, i.stages_ms) for i in items] == [
        (ItemStatus.SUCCEEDED, None, None, None),
        (ItemStatus.SUCCEEDED, None, None, None),
    ]


def test_upsert_results_of_nothing_is_a_no_op(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING])
    queries.upsert_results(session, job.id, 0, [])
    assert snapshot(session, job.id)[0][3] == ItemStatus.PENDING


def test_finished_items_are_those_not_open(session: Session) -> None:
    job = make_job(
        session,
        [ItemStatus.PENDING, ItemStatus.RUNNING, ItemStatus.SUCCEEDED, ItemStatus.CANCELLED],
    )
    other = make_job(session, [ItemStatus.SUCCEEDED])  # same chunk number, another job
    assert [i.key for i in queries.finished_chunk_items(session, job.id, 0)] == ["k2", "k3"]
    assert [i.key for i in queries.finished_chunk_items(session, other.id, 0)] == ["k0"]


def test_cancel_items_cancels_only_pending(session: Session) -> None:
    job = make_job(
        session, [ItemStatus.PENDING, ItemStatus.RUNNING, ItemStatus.SUCCEEDED, ItemStatus.PENDING]
    )
    assert queries.cancel_items(session, job.id) == 2
    session.commit()
    assert [i.status for i in items_of(session, job.id)] == [
        ItemStatus.CANCELLED,
        ItemStatus.RUNNING,
        ItemStatus.SUCCEEDED,
        ItemStatus.CANCELLED,
    ]


# --- closing -------------------------------------------------------------------------------


def test_closing_waits_for_open_items(session: Session) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED, ItemStatus.RUNNING])
    assert queries.closing(session, job.id, []) is None


def test_closing_reads_the_job_its_counts_and_its_chunks_once_nothing_is_open(
    session: Session,
) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED])
    session.execute(update(Item).where(Item.job_id == job.id, Item.key == "k2").values(chunk=3))
    session.commit()

    found = queries.closing(session, job.id, written=[0])

    assert found is not None
    assert found.job.id == job.id and found.job.status == JobStatus.RUNNING
    assert found.counts == queries.Counts(total=3, succeeded=1, failed=1, cancelled=1)
    assert found.chunks == [0, 3]
    # the items of the chunk with no shard come with the read
    assert {chunk: [i.key for i in items] for chunk, items in found.unwritten.items()} == {
        3: ["k2"]
    }
    assert queries.closing(session, job.id, written=[0, 3]).unwritten == {}  # type: ignore[union-attr]
    by_chunk = queries.chunk_items(session, job.id, [3, 5])
    assert {chunk: [i.key for i in items] for chunk, items in by_chunk.items()} == {
        3: ["k2"], 5: [],
    }  # fmt: skip


def test_closing_of_an_unknown_job_is_none(session: Session) -> None:
    assert queries.closing(session, "nope", []) is None


# --- finish_job_if_done -------------------------------------------------------------------


def test_finish_job_if_done_waits_for_open_items(session: Session) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED, ItemStatus.RUNNING])
    assert queries.finish_job_if_done(session, job.id) is None
    session.commit()
    session.expire_all()
    assert session.get(Job, job.id).status == JobStatus.RUNNING  # type: ignore[union-attr]


def test_finish_job_if_done_answers_exactly_once(session: Session) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED, ItemStatus.FAILED])

    finished = queries.finish_job_if_done(session, job.id)
    assert finished is not None and finished.status == JobStatus.COMPLETED
    session.commit()
    assert queries.finish_job_if_done(session, job.id) is None
    session.commit()

    session.expire_all()
    closed = session.get(Job, job.id)
    assert closed is not None
    assert closed.status == JobStatus.COMPLETED  # failed items still complete the job
    assert closed.finished_at is not None


def test_finish_job_if_done_maps_cancelling_to_cancelled(session: Session) -> None:
    job = make_job(
        session, [ItemStatus.SUCCEEDED, ItemStatus.CANCELLED], status=JobStatus.CANCELLING
    )
    finished = queries.finish_job_if_done(session, job.id)
    assert finished is not None and finished.status == JobStatus.CANCELLED
    assert queries.finish_job_if_done(session, job.id) is None
    session.commit()
    session.expire_all()
    assert session.get(Job, job.id).status == JobStatus.CANCELLED  # type: ignore[union-attr]


def test_finish_job_if_done_closes_a_queued_job_and_sets_started_at(session: Session) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED], status=JobStatus.QUEUED)
    finished = queries.finish_job_if_done(session, job.id)
    assert finished is not None and finished.status == JobStatus.COMPLETED
    session.commit()
    session.expire_all()
    closed = session.get(Job, job.id)
    assert closed is not None and closed.started_at is not None
    assert closed.started_at <= closed.finished_at  # type: ignore[operator]
    # what the close returns is what it stored
    assert (aware(finished.started_at), aware(finished.finished_at)) == (
        aware(closed.started_at), aware(closed.finished_at),
    )  # fmt: skip


@pytest.mark.parametrize("status", [JobStatus.FAILED, JobStatus.COMPLETED, JobStatus.CANCELLED])
def test_finish_job_if_done_leaves_a_closed_job_alone(session: Session, status: str) -> None:
    job = make_job(session, [ItemStatus.SUCCEEDED], status=status)
    assert queries.finish_job_if_done(session, job.id) is None
    session.commit()
    session.expire_all()
    assert session.get(Job, job.id).status == status  # type: ignore[union-attr]


def test_is_open() -> None:
    assert queries.is_open(Job(status=JobStatus.QUEUED))
    assert queries.is_open(Job(status=JobStatus.RUNNING))
    assert queries.is_open(Job(status=JobStatus.CANCELLING))
    assert not queries.is_open(Job(status=JobStatus.COMPLETED))
    assert not queries.is_open(Job(status=JobStatus.FAILED))
    assert not queries.is_open(Job(status=JobStatus.CANCELLED))


# --- tenant_job, list_items, list_jobs ----------------------------------------------------


def test_tenant_job_sees_only_the_tenants_jobs(session: Session) -> None:
    job = make_job(session, tenant="acme")
    assert queries.tenant_job(session, "acme", job.id) is job
    assert queries.tenant_job(session, "globex", job.id) is None
    assert queries.lock_job(session, job.id, "globex") is None
    assert queries.lock_job(session, job.id) is job


def test_list_items_pages_in_id_order_with_a_status_filter(session: Session) -> None:
    statuses = [ItemStatus.SUCCEEDED, ItemStatus.FAILED] * 3
    job = make_job(session, statuses)
    ids = [i.id for i in items_of(session, job.id)]

    first = queries.list_items(session, job.id, status=None, after=0, limit=4)
    rest = queries.list_items(session, job.id, status=None, after=first[-1].id, limit=4)
    assert [i.id for i in first + rest] == ids
    assert len(rest) == 2

    failed = queries.list_items(session, job.id, status=ItemStatus.FAILED, after=0, limit=10)
    assert [i.key for i in failed] == ["k1", "k3", "k5"]


def test_list_jobs_pages_newest_first_through_created_at_ties(session: Session) -> None:
    base = utcnow().replace(microsecond=0)
    times = [base, base + timedelta(seconds=1), base + timedelta(seconds=1)]
    times += [base + timedelta(seconds=1), base + timedelta(seconds=2)]
    jobs = [make_job(session, created_at=t) for t in times]
    make_job(session, tenant="globex", created_at=base + timedelta(seconds=1))
    expected = [j.id for j in sorted(jobs, key=lambda j: (j.created_at, j.id), reverse=True)]

    seen: list[str] = []
    after: Job | None = None
    for _ in range(10):
        page = queries.list_jobs(session, "acme", after=after, limit=2)
        if not page:
            break
        assert len(page) <= 2
        seen += [j.id for j in page]
        after = page[-1]
    assert seen == expected
    assert seen[0] == jobs[4].id and seen[-1] == jobs[0].id


def test_list_jobs_cursor_inside_a_tie_returns_the_rest_of_it(session: Session) -> None:
    when = utcnow()
    ids = ["a" * 8, "b" * 8, "c" * 8]
    for job_id in ids:
        make_job(session, created_at=when, job_id=job_id)
    cursor = session.get(Job, "b" * 8)
    assert [j.id for j in queries.list_jobs(session, "acme", after=cursor, limit=10)] == ["a" * 8]
    assert [j.id for j in queries.list_jobs(session, "acme", after=None, limit=10)] == ids[::-1]


def test_list_jobs_keeps_a_status_a_pipelines_runs_and_a_schedules_runs(
    session: Session,
) -> None:
    nightly = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://b/"}, model="phash")
    theirs = Pipeline(tenant="globex", name="nightly", source={"s3": "s3://b/"}, model="phash")
    session.add_all([nightly, theirs])
    session.flush()
    base = utcnow()
    by_hand = make_job(session, status=JobStatus.COMPLETED, created_at=base)
    scheduled = make_job(session, status=JobStatus.FAILED, created_at=base + timedelta(seconds=1))
    other = make_job(session, status=JobStatus.FAILED, created_at=base + timedelta(seconds=2))
    foreign = make_job(session, tenant="globex", created_at=base + timedelta(seconds=3))
    by_hand.pipeline_id = scheduled.pipeline_id = nightly.id
    scheduled.schedule = "nightly"
    foreign.pipeline_id, foreign.schedule = theirs.id, "nightly"
    session.commit()

    def listed(**only: str) -> list[str]:
        kept = queries.JobFilter(**only)
        return [j.id for j in queries.list_jobs(session, "acme", after=None, limit=10, only=kept)]

    assert listed() == [other.id, scheduled.id, by_hand.id]
    assert listed(status="failed") == [other.id, scheduled.id]
    assert listed(pipeline="nightly") == [scheduled.id, by_hand.id]
    assert listed(schedule="nightly") == [scheduled.id]
    assert listed(pipeline="nightly", status="completed") == [by_hand.id]
    assert listed(pipeline="weekly") == listed(schedule="weekly") == []
    first = queries.list_jobs(
        session, "acme", after=None, limit=1, only=queries.JobFilter("failed")
    )
    rest = queries.list_jobs(
        session, "acme", after=first[0], limit=5, only=queries.JobFilter("failed")
    )
    assert [j.id for j in first + rest] == [other.id, scheduled.id]


def test_items_a_fallback_took_are_counted_once(session: Session) -> None:
    job = make_job(session, [ItemStatus.PENDING] * 3)
    leases.take(session, job.id, [i.id for i in items_of(session, job.id)], "run-1", 60)
    rows = [
        result_row("k0", answered_by="classifier:1"),
        result_row("k1", answered_by="ocr", fallback_reason="Refused: the top score 0.2 …"),
        result_row("k2", ItemStatus.FAILED, error="Both failed.", outputs=None,
                   fallback_reason="The file is not an image Kiln can read."),
    ]  # fmt: skip
    queries.upsert_results(session, job.id, 0, rows, "run-1")
    queries.upsert_results(session, job.id, 0, rows, "run-1")  # a replay counts nothing
    session.commit()
    counts = queries.job_counts(session, job.id)
    assert (counts.succeeded, counts.failed, counts.fell_back, counts.fell_back_succeeded) == (
        2, 1, 2, 1,
    )  # fmt: skip
    assert counters.recount(session, job.id) == counters.read(session, job.id)
    assert [i.answered_by for i in items_of(session, job.id)] == ["classifier:1", "ocr", None]


def test_the_sqlite_results_statement_looks_each_row_up_by_its_key(session: Session) -> None:
    """The chunk's rows are materialized, then each item found through (job_id, key): joined
    to json_each directly, SQLite scanned every item of the job for every row of the chunk
    (21 s for 512 rows of a 100,000-item job). Each row's outputs are found by position, not
    by a scan of the rows' document per output (that took 33 ms for 512 rows)."""
    job = make_job(session, [ItemStatus.RUNNING] * 3)
    docs = queries._documents([result_row(f"k{i}") for i in range(3)], postgres=False)
    statement = str(queries._UPDATE_SQLITE)
    params = {"job_id": job.id, "owner": None, "finished_at": "x", **docs}
    connection = session.connection().connection.driver_connection
    plan = [row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {statement}", params)]
    assert any(step.startswith("MATERIALIZE v") for step in plan), plan
    assert any(step.startswith("SEARCH o USING") and "i=?" in step for step in plan), plan
    assert any(step.startswith("SEARCH items USING INDEX") and "key=?" in step for step in plan), (
        plan
    )
