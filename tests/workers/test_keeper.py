"""Leases from the worker's side: kept alive while a chunk runs, noticed when lost or when the
job is cancelled, and re-sent by the reconciler when their run died or their message was lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, update

from devstack.images import solid
from kiln.app.db import chunk_runs, leases
from kiln.app.db.models import ChunkRun, Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import LeaseTiming, cancel_job, progress
from kiln.app.results import results
from kiln.workers.chunk import answer as answer_module
from kiln.workers.chunk.run import process_chunk
from kiln.workers.jobs.periodic import reconcile
from kiln.workers.ops.keeper import Leases, _keep_s
from kiln.workers.runtime import WorkerRuntime
from tests.workers.chunk.test_run import FILES, items_by_key, job_row, manifest, shard_rows, submit
from tests.workers.colours import MODEL


@contextmanager
def statements_seen(runtime: WorkerRuntime, seen: list[str]) -> Iterator[None]:
    """The SQL statements the runtime's database engine runs inside the block."""

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(runtime.db, "before_cursor_execute", record)
    try:
        yield
    finally:
        event.remove(runtime.db, "before_cursor_execute", record)


def _take(runtime: WorkerRuntime, job_id: str, ids: list[int], owner: str, lease_s: float) -> None:
    with runtime.sessions() as session:
        leases.take(session, job_id, ids, owner, lease_s)
        session.commit()


def _expire(runtime: WorkerRuntime, job_id: str) -> None:
    with runtime.sessions() as session:
        session.execute(
            update(Item)
            .where(Item.job_id == job_id)
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()


def test_the_keeper_renews_the_lease_while_the_run_lives(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "run-a", lease_s=0.5)
    keeper = Leases(runtime.sessions, lease_s=0.5, renew_s=0.05)
    with keeper.hold(job_id, "run-a") as held:
        time.sleep(1.2)  # more than twice the lease
        with runtime.sessions() as session:
            assert leases.reset_expired(session) == set()
        assert not held.lost.is_set() and not held.cancelled.is_set()
    time.sleep(0.6)  # the run let go: the lease runs out
    with runtime.sessions() as session:
        assert leases.reset_expired(session) == {(job_id, 0)}
    keeper.close()


def test_the_keeper_sees_a_cancel_and_a_lost_lease(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "run-a", lease_s=30)
    keeper = Leases(runtime.sessions, lease_s=30, renew_s=0.05)
    with keeper.hold(job_id, "run-a") as held:
        with runtime.sessions() as session:
            cancel_job(session, "acme", job_id)
        assert held.cancelled.wait(2)
        _expire(runtime, job_id)
        _take(runtime, job_id, calls[0].item_ids, "run-b", lease_s=30)
        assert held.lost.wait(2)
    keeper.close()


def test_one_keeper_renews_every_run_of_the_process_in_one_statement(
    runtime: WorkerRuntime,
) -> None:
    """Two chunks' runs, one thread: both leases live on, and a renewal is one UPDATE."""
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "run-a", lease_s=0.5)
    _take(runtime, job_id, calls[1].item_ids, "run-b", lease_s=0.5)
    keeper = Leases(runtime.sessions, lease_s=0.5, renew_s=0.05)
    statements: list[str] = []
    with keeper.hold(job_id, "run-a") as a, keeper.hold(job_id, "run-b") as b:
        with statements_seen(runtime, statements):
            keeper.renew_once()
        time.sleep(1.2)
        with runtime.sessions() as session:
            assert leases.reset_expired(session) == set()
        assert not (a.lost.is_set() or b.lost.is_set())
    keeper.close()
    assert sum(s.lstrip().upper().startswith("UPDATE ITEMS") for s in statements) == 1


def test_a_cancel_stops_a_running_chunk_between_inputs(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel arrives while the first input is being fetched: no input has reached a batch,
    so every one is cancelled — the one in prep as it comes back, the others before they are
    sent — and the job closes as cancelled."""
    monkeypatch.setattr(answer_module, "UNIT_ROWS", 1)
    runtime.settings.lease_renew_s = 0.05
    job_id, calls = submit(runtime)
    fetch = runtime.fetcher.fetch
    fetched: list[str] = []

    def fetch_then_cancel(source: str | None, limit: int) -> Any:
        fetched.append(source or "")
        if len(fetched) == 1:
            with runtime.sessions() as session:
                cancel_job(session, "acme", job_id)
            time.sleep(0.5)  # the keeper notices within a renewal or two
        return fetch(source, limit)

    monkeypatch.setattr(runtime.fetcher, "fetch", fetch_then_cancel)
    report = process_chunk(runtime, job_id, 0, calls[0].item_ids)

    items = items_by_key(runtime, job_id)
    assert len(fetched) == 1 and report.processed == 0
    assert [items[k].status for k in ("r.png", "g.png", "b.png", "notes.txt", "b2.png")] == [
        ItemStatus.CANCELLED
    ] * 5
    assert items["g.png"].error == "The job was cancelled."
    assert job_row(runtime, job_id).status == JobStatus.CANCELLED
    assert [r["key"] for r in shard_rows(runtime, job_id, 0)] == ["r.png", "g.png", "b.png"]


def test_a_duplicate_message_drops_out_while_the_first_run_holds_the_chunk(
    runtime: WorkerRuntime,
) -> None:
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "live-run", lease_s=60)
    report = process_chunk(runtime, job_id, 0, calls[0].item_ids)
    assert report.processed == 0
    assert {items_by_key(runtime, job_id)[k].status for k in ("r.png", "g.png", "b.png")} == {
        ItemStatus.RUNNING
    }
    place = results.Place(runtime.store, results.results_prefix(job_id))
    assert not runtime.store.exists(results.shard_key(place, 0))  # no partial shard written


def test_the_reconciler_resends_a_dead_runs_chunk_and_the_job_completes(
    runtime: WorkerRuntime,
) -> None:
    """A worker was killed with chunk 0 leased: its lease runs out, the reconciler sends the
    chunk again (whatever the broker says), and every item ends with one result."""
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "killed-run", lease_s=60)
    process_chunk(runtime, job_id, 1, calls[1].item_ids)
    dispatcher = RecordingDispatcher()
    assert reconcile(runtime, dispatcher, lambda: set())["chunks_resent"] == 0  # lease live

    _expire(runtime, job_id)
    report = reconcile(runtime, dispatcher, lambda: None)  # broker unreadable: still re-sent
    assert report == {
        "ingests_resumed": 0,
        "chunks_expired": 1,
        "chunks_resent": 1,
        "jobs_closed": 0,
        "cache_purged": 0,
        "runs_forgotten": 0,
        "expiries_set": 0,
        "jobs_expired": 0,
        "expired_rows": 0,
        "expired_objects": 0,
        "chunks_topped_up": 0,
    }
    [resent] = dispatcher.calls
    assert (resent.chunk, resent.item_ids, resent.queue) == (0, calls[0].item_ids, "interactive")

    process_chunk(runtime, resent.job_id, resent.chunk, resent.item_ids)
    items = items_by_key(runtime, job_id)
    assert job_row(runtime, job_id).status == JobStatus.COMPLETED
    assert [items[k].attempts for k in ("r.png", "g.png", "b.png")] == [2, 2, 2]
    assert manifest(runtime, job_id)["counts"]["total"] == len(FILES)
    assert [len(shard_rows(runtime, job_id, c)) for c in (0, 1)] == [3, 2]


def test_the_reconciler_resends_pending_chunks_the_broker_lost(runtime: WorkerRuntime) -> None:
    job_id, _calls = submit(runtime)
    with runtime.sessions() as session:  # sent long ago, never run: Redis was flushed
        session.execute(update(Item).values(queued_at=utcnow() - timedelta(hours=1)))
        session.commit()
    dispatcher = RecordingDispatcher()

    assert reconcile(runtime, dispatcher, lambda: None)["chunks_resent"] == 0  # unknown: wait
    assert reconcile(runtime, dispatcher, lambda: {(job_id, 0)})["chunks_resent"] == 1
    assert [c.chunk for c in dispatcher.calls] == [1]  # chunk 0 is still queued
    assert reconcile(runtime, dispatcher, lambda: set())["chunks_resent"] == 1  # not chunk 1 again
    assert [c.chunk for c in dispatcher.calls] == [1, 0]


def test_an_input_that_keeps_killing_its_runs_fails_with_the_reason(
    runtime: WorkerRuntime,
) -> None:
    job_id, calls = submit(runtime)
    limit = runtime.settings.max_attempts
    with runtime.sessions() as session:
        session.execute(update(Item).where(Item.key == "g.png").values(attempts=limit))
        session.commit()
    process_chunk(runtime, job_id, 0, calls[0].item_ids)
    items = items_by_key(runtime, job_id)
    assert items["r.png"].status == ItemStatus.SUCCEEDED
    assert items["g.png"].status == ItemStatus.FAILED
    assert f"gave up on this input after {limit} attempts" in (items["g.png"].error or "")


def test_a_cancel_takes_back_the_rows_waiting_for_the_engine(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine is busy with the chunk's first batch when the cancel comes: the rows no batch
    has taken are cancelled within a moment (not run after it), the rows the engine has keep
    their results, and the database, the counters and the shard agree."""
    monkeypatch.setattr(answer_module, "UNIT_ROWS", 4)
    runtime.settings.cancel_check_s = 0.05
    files = [(f"c{i:02d}.png", solid((10 * i, 5, 250 - 10 * i))) for i in range(24)]
    job_id, calls = submit(runtime, files)
    with runtime.models.using(runtime_model(runtime)) as runner:
        batcher = runner.batcher
        engine = batcher.fn
        seen: list[int] = []
        busy = threading.Event()

        def slow_engine(parts: Any) -> Any:
            seen.append(sum(len(part) for part in parts))
            busy.set()
            time.sleep(1.0)  # a batch on a slow engine
            return engine(parts)

        monkeypatch.setattr(batcher, "fn", slow_engine)
        cancelled_at: list[float] = []

        def cancel_once_busy() -> None:
            busy.wait(10)
            with runtime.sessions() as session:
                cancel_job(session, "acme", job_id)
            cancelled_at.append(time.monotonic())

        canceller = threading.Thread(target=cancel_once_busy)
        canceller.start()
        ids = [item_id for call in calls for item_id in call.item_ids]
        report = process_chunk(runtime, job_id, 0, ids, owner="one-run")
        canceller.join()

    ran = sum(seen)
    assert 0 < ran < len(files)
    assert report.processed == ran and report.job_status == JobStatus.CANCELLED
    # The batches already running finish; nothing else starts: at most about one batch's time.
    assert time.monotonic() - cancelled_at[0] < 2.5
    items = items_by_key(runtime, job_id)
    statuses = [item.status for item in items.values()]
    assert statuses.count(ItemStatus.SUCCEEDED) == ran
    assert statuses.count(ItemStatus.CANCELLED) == len(files) - ran
    shard = shard_rows(runtime, job_id, 0)
    assert {row["key"]: row["status"] for row in shard} == {k: i.status for k, i in items.items()}
    counts = manifest(runtime, job_id)["counts"]
    assert (counts["succeeded"], counts["cancelled"]) == (ran, len(files) - ran)


def runtime_model(runtime: WorkerRuntime) -> Any:
    with runtime.sessions() as session:
        return runtime.model_info(session, MODEL, "acme")


def test_the_keeper_publishes_what_a_run_has_answered_until_it_ends(
    runtime: WorkerRuntime,
) -> None:
    """A job's progress moves between its chunks' commits: the keeper publishes each run's
    answered rows every tick, and forgets them once the run has ended."""
    job_id, calls = submit(runtime)
    ids = calls[0].item_ids
    _take(runtime, job_id, ids, "run-p", lease_s=30)
    with runtime.sessions() as session:
        session.execute(
            update(Job).where(Job.id == job_id).values(status="running", started_at=utcnow())
        )
        session.commit()
    keeper = Leases(runtime.sessions, lease_s=30, renew_s=0.05)

    def answered() -> int:
        with runtime.sessions() as session:
            return chunk_runs.in_flight(session, job_id, utcnow() - timedelta(seconds=10)).answered

    with keeper.hold(job_id, "run-p") as held:
        held.answered = 2
        assert _eventually(lambda: answered() == 2)
        with runtime.sessions() as session:
            report = progress(session, job_row(runtime, job_id), LeaseTiming(30, 0.05))
            assert (report.running, report.answered) == (len(ids), 2)
            assert report.processed == 2
    assert _eventually(lambda: answered() == 0)
    keeper.close()


def test_a_run_writing_its_results_stays_in_the_jobs_progress(runtime: WorkerRuntime) -> None:
    """A run writing its results publishes no more (its write deletes its row, which a publish
    would bring back), but the keeper keeps its row fresh: a write slower than the staleness
    limit dropped its answered rows from the job's progress until the write committed."""
    job_id, calls = submit(runtime)
    _take(runtime, job_id, calls[0].item_ids, "run-w", lease_s=30)
    keeper = Leases(runtime.sessions, lease_s=30, renew_s=0.05)

    def touched() -> datetime | None:
        with runtime.sessions() as session:
            return session.scalar(select(ChunkRun.updated_at).where(ChunkRun.owner == "run-w"))

    with keeper.hold(job_id, "run-w") as held:
        held.answered = 2
        assert _eventually(lambda: touched() is not None)
        held.writing = True
        first = touched()
        assert _eventually(lambda: (touched() or first) > first)  # type: ignore[operator]
        with runtime.sessions() as session, unit_of_work(session):
            chunk_runs.forget(session, ["run-w"])  # the write's unit of work
        time.sleep(0.2)  # renewal ticks: the row stays gone
        assert touched() is None
    keeper.close()


def test_the_reconciler_forgets_the_progress_of_a_dead_workers_runs(
    runtime: WorkerRuntime,
) -> None:
    job_id, _calls = submit(runtime)
    long_ago = utcnow() - timedelta(hours=1)
    with runtime.sessions() as session:
        chunk_runs.publish(session, [chunk_runs.RunTally("dead-run", job_id, 3, long_ago)])
        session.execute(update(ChunkRun).values(updated_at=long_ago))
        session.commit()
    report = reconcile(runtime, RecordingDispatcher(), lambda: set())
    assert report["runs_forgotten"] == 1


def _eventually(check: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize(("lease_s", "renew_s"), [(60.0, 3.0), (0.5, 0.05), (30.0, 10.0)])
def test_a_row_is_rewritten_before_a_reader_takes_its_run_for_stopped(
    lease_s: float, renew_s: float
) -> None:
    """The keeper spares rows with lease enough left, but rewrites each a tick before its
    lease looks stale to the API (`LeaseTiming.stale_s`), or at half its lease."""
    keep_s = _keep_s(lease_s, renew_s)
    oldest = lease_s - keep_s + renew_s  # the age of a row's lease at its rewrite, at most
    stale_s = LeaseTiming(lease_s, renew_s).stale_s
    assert oldest < stale_s or keep_s == lease_s / 2
    assert lease_s / 2 <= keep_s < lease_s
