"""A stuck engine and a deadlocked work thread, end to end through `process_chunk`: the rows
fail as transient errors or the lease is left to run out, the reconciler can hand the items
to another run, and the worker reports itself unhealthy until the work comes back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kiln.app.db import leases
from kiln.app.db.models import ItemStatus
from kiln.workers.batching import BatchDeadlineError
from kiln.workers.chunk.run import process_chunk
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings
from tests.workers.chunk.test_run import items_by_key, submit
from tests.workers.colours import MODEL, colours_runtime


@pytest.fixture
def impatient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerRuntime]:
    """A runtime whose batches may take 0.3 s and whose runs may hold their lease for 0.5 s;
    prep on the chunk's thread (a test's stand-in fetcher is what runs)."""
    settings = migrated_settings(
        tmp_path, monkeypatch, chunk_size=3, max_batch=8, max_delay_ms=2,
        batch_deadline_s=0.3, run_max_s=0.5, lease_s=0.4, lease_renew_s=0.05, prep_processes=0,
    )  # fmt: skip
    with colours_runtime(settings, tmp_path) as runtime:
        yield runtime


def _hang_engine(runtime: WorkerRuntime, release: threading.Event) -> None:
    """Make the colours model's engine block until `release` (a wedged GPU call)."""
    with runtime.sessions() as session:
        runner = runtime.models.runner(runtime.model_info(session, MODEL, "acme"))
    real = runner.batcher.fn

    def hang(rows: Sequence[Any]) -> Sequence[Any]:
        release.wait(30)
        return real(rows)

    runner.batcher.fn = hang


def test_a_stuck_engine_fails_the_chunk_as_transient_and_the_worker_unhealthy(
    impatient: WorkerRuntime,
) -> None:
    job_id, calls = submit(impatient)
    release = threading.Event()
    _hang_engine(impatient, release)
    started = time.monotonic()
    with pytest.raises(BatchDeadlineError, match="engine looks stuck"):
        process_chunk(impatient, job_id, 0, calls[0].item_ids)
    assert time.monotonic() - started < 5  # the deadline, not the hang, ended it
    items = items_by_key(impatient, job_id)
    chunk = [i for i in items.values() if i.chunk == 0]
    # Released at once for the task's retry (on any worker), not left running.
    assert {i.status for i in chunk} == {ItemStatus.PENDING}
    assert all(i.lease_owner is None for i in chunk)
    [problem] = impatient.health.problems()
    assert "has run for more than 0.3 s; the engine looks stuck" in problem
    release.set()  # the engine comes back: the worker is healthy again
    deadline = time.monotonic() + 5
    while impatient.health.problems() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert impatient.health.problems() == []


def test_a_deadlocked_work_thread_stops_renewing_and_its_items_are_reclaimed(
    impatient: WorkerRuntime,
) -> None:
    job_id, calls = submit(impatient)
    stuck = threading.Event()
    release = threading.Event()

    real_fetch = impatient.fetcher.fetch

    def deadlocked_fetch(source: str | None, limit: int) -> bytes:
        stuck.set()
        release.wait(30)
        return real_fetch(source, limit)

    impatient.fetcher.fetch = deadlocked_fetch  # type: ignore[method-assign, assignment]
    outcome: list[Any] = []
    run = threading.Thread(
        target=lambda: outcome.append(_try(process_chunk, impatient, job_id, 0, calls[0].item_ids))
    )
    run.start()
    assert stuck.wait(5)
    time.sleep(0.5 + 0.4 + 0.2)  # past run_max_s, then past the last renewal's lease
    assert impatient.health.problems(), "the overlong run makes the worker unhealthy"
    with impatient.sessions() as session:
        assert leases.reset_expired(session) == {(job_id, 0)}  # the reconciler reclaims them
        session.commit()
    release.set()
    run.join(10)
    assert not run.is_alive()
    assert impatient.health.problems() == []  # the run ended
    [report] = outcome
    assert isinstance(report, ChunkReport) and report.job_status is None  # it wrote nothing
    items = items_by_key(impatient, job_id)
    assert {i.status for i in items.values() if i.chunk == 0} == {ItemStatus.PENDING}
    assert all(i.outputs is None for i in items.values() if i.chunk == 0)


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as error:  # the outcome is checked by the test, not here
        return error
