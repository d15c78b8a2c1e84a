"""The bulk queue's fair share (app/jobs/fair_share.py): the weighted, max-min fair split of the
window (pure), and the top-up on a migrated SQLite database — chunks sent in order up to each
job's cap, recorded sent, the rest left for the next top-up; a lone tenant gets the whole
window; a second tenant's job gets its share at once; weights skew the split."""

from __future__ import annotations

from collections import Counter

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.db import fair_share as db
from kiln.app.db import ingest as ingest_db
from kiln.app.db import leases
from kiln.app.db.models import Ingest, Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.fair_share import Claim, allocate, plan, top_up, window_of
from kiln.app.tenants.shares import set_weight
from tests.app.db.test_queries import make_job

# --- the split (pure) --------------------------------------------------------------------


def test_equal_weights_split_the_window_evenly() -> None:
    assert allocate(8, {"a": Claim(1, 100), "b": Claim(1, 100)}) == {"a": 4, "b": 4}


def test_a_lone_party_gets_the_whole_window() -> None:
    assert allocate(8, {"a": Claim(1, 100)}) == {"a": 8}


def test_what_a_party_does_not_need_goes_to_the_others() -> None:
    assert allocate(12, {"a": Claim(1, 100), "b": Claim(1, 2), "c": Claim(1, 100)}) == {
        "a": 5,
        "b": 2,
        "c": 5,
    }


def test_weights_skew_the_split() -> None:
    assert allocate(9, {"a": Claim(2, 100), "b": Claim(1, 100)}) == {"a": 6, "b": 3}


def test_every_party_with_work_gets_a_chunk_even_on_a_small_window() -> None:
    caps = allocate(2, {k: Claim(1, 10) for k in "abc"})
    assert caps == {"a": 1, "b": 1, "c": 1}


def test_a_party_with_nothing_to_do_gets_nothing() -> None:
    assert allocate(8, {"a": Claim(1, 0), "b": Claim(1, 5)}) == {"b": 5}


def bulk(job_id: str, tenant: str, in_flight: int, unsent: int, weight: float = 1.0) -> db.BulkJob:
    return db.BulkJob(job_id, tenant, weight, in_flight, unsent)


def test_a_tenant_s_share_is_split_over_its_jobs_not_per_job() -> None:
    """Tenant A's four jobs share A's half; B's one job has B's half to itself."""
    jobs = [bulk(f"a{i}", "A", 4, 100) for i in range(4)] + [bulk("b", "B", 0, 100)]
    caps = plan(16, jobs)
    assert caps == {"a0": 2, "a1": 2, "a2": 2, "a3": 2, "b": 8}


def test_a_job_with_nothing_left_to_send_gets_no_cap() -> None:
    caps = plan(8, [bulk("a", "A", 3, 0), bulk("b", "B", 0, 10)])
    assert caps == {"b": 5}  # A's 3 in flight still count: B gets the rest of the window


def test_the_window_is_per_task_thread_of_each_live_worker(settings: Settings) -> None:
    per_worker = settings.fair_share_window_per_slot * settings.task_threads
    assert window_of(settings, 3) == 3 * per_worker
    assert window_of(settings, 0) == per_worker  # no facts yet (kiln run): one worker's worth


# --- the top-up on the database --------------------------------------------------------------


@pytest.fixture
def small_window(settings: Settings) -> Settings:
    """A window of 4 chunks (one live worker or none: 2 per thread × 2 threads)."""
    return settings.model_copy(update={"fair_share_window_per_slot": 2, "worker_concurrency": 2})


def recorded_bulk_job(session: Session, tenant: str, chunks: int, size: int = 2) -> Job:
    """A running bulk job whose ingest recorded `chunks` chunks of `size` items, none sent."""
    job = make_job(session, tenant=tenant)
    job.queue = "bulk"
    session.add(Ingest(job_id=job.id, chunks_sent=0))
    objects = [ingest_db.Listed(f"{tenant}-{i}", "e") for i in range(chunks * size)]
    job.chunk_count = ingest_db.insert_items(session, job.id, "photos", objects, 0, size)
    session.commit()
    return job


def sent_by_job(dispatcher: RecordingDispatcher) -> Counter[str]:
    return Counter(call.job_id for call in dispatcher.calls)


def finish_chunk(session: Session, job_id: str, chunk: int) -> None:
    session.execute(
        update(Item)
        .where(Item.job_id == job_id, Item.chunk == chunk)
        .values(status=ItemStatus.SUCCEEDED, finished_at=utcnow())
    )
    session.commit()


def test_a_lone_tenant_s_job_gets_the_whole_window_in_chunk_order(
    sessions: sessionmaker[Session], small_window: Settings
) -> None:
    with sessions() as session:
        job = recorded_bulk_job(session, "acme", 10)
    dispatcher = RecordingDispatcher()

    assert top_up(sessions, dispatcher, small_window) == 4
    assert [c.chunk for c in dispatcher.calls] == [0, 1, 2, 3]
    assert all(c.queue == "bulk" and len(c.item_ids) == 2 for c in dispatcher.calls)
    with sessions() as session:
        assert session.get(Ingest, job.id).chunks_sent == 4  # type: ignore[union-attr]
        # however old, the reconciler takes only sent chunks for lost ones, never unsent ones
        stranded = leases.stranded_chunks(session, older_than_s=-1)
        assert sorted(c.chunk for c in stranded) == [0, 1, 2, 3]

    assert top_up(sessions, dispatcher, small_window) == 0  # the window is full
    with sessions() as session:
        finish_chunk(session, job.id, 0)
    assert top_up(sessions, dispatcher, small_window) == 1
    assert dispatcher.calls[-1].chunk == 4


def test_a_second_tenant_gets_its_share_as_the_first_s_chunks_finish(
    sessions: sessionmaker[Session], small_window: Settings
) -> None:
    dispatcher = RecordingDispatcher()
    with sessions() as session:
        a = recorded_bulk_job(session, "tenant-a", 20)
    top_up(sessions, dispatcher, small_window)
    with sessions() as session:
        b = recorded_bulk_job(session, "tenant-b", 20)
    top_up(sessions, dispatcher, small_window)
    # A holds the whole window (4) and is over its half now; B's half goes out at once
    assert sent_by_job(dispatcher) == Counter({a.id: 4, b.id: 2})

    for chunk in range(2):  # A's chunks finish: A is still at its half, nothing is sent
        with sessions() as session:
            finish_chunk(session, a.id, chunk)
        assert top_up(sessions, dispatcher, small_window) == 0
    with sessions() as session:
        in_flight = {j.job_id: j.in_flight for j in db.open_bulk_jobs(session)}
    assert in_flight == {a.id: 2, b.id: 2}
    for job, chunk in ((a, 2), (b, 0)):  # each one's finish is replaced by its own next chunk
        with sessions() as session:
            finish_chunk(session, job.id, chunk)
        assert top_up(sessions, dispatcher, small_window) == 1
        assert dispatcher.calls[-1].job_id == job.id
    assert sent_by_job(dispatcher) == Counter({a.id: 5, b.id: 3})


def test_a_heavier_tenant_gets_more_of_the_window(
    sessions: sessionmaker[Session], settings: Settings
) -> None:
    window = settings.model_copy(update={"fair_share_window_per_slot": 3, "worker_concurrency": 3})
    with sessions() as session:
        set_weight(session, "big", 2)
        big = recorded_bulk_job(session, "big", 20)
        small = recorded_bulk_job(session, "small", 20)
    dispatcher = RecordingDispatcher()
    top_up(sessions, dispatcher, window)
    assert sent_by_job(dispatcher) == Counter({big.id: 6, small.id: 3})


def test_a_cancelled_or_closed_job_sends_nothing(
    sessions: sessionmaker[Session], small_window: Settings
) -> None:
    with sessions() as session:
        job = recorded_bulk_job(session, "acme", 3)
        session.execute(update(Job).values(status=JobStatus.CANCELLING))
        session.commit()
    dispatcher = RecordingDispatcher()
    assert top_up(sessions, dispatcher, small_window) == 0 and dispatcher.calls == []
    with sessions() as session:
        assert session.scalar(select(Ingest.chunks_sent).where(Ingest.job_id == job.id)) == 0


def test_jobs_without_an_ingest_are_not_the_fair_share_s(
    sessions: sessionmaker[Session], small_window: Settings
) -> None:
    """A job submitted with its inputs is sent whole by the API: nothing to top up."""
    with sessions() as session:
        make_job(session, [ItemStatus.PENDING] * 5)
        session.commit()
        assert db.open_bulk_jobs(session) == []
    assert top_up(sessions, RecordingDispatcher(), small_window) == 0
