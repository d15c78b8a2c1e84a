"""The Celery task adapters (workers/celery/tasks.py) call the plain functions with the right
arguments, under the contract's names, and retry what is transient.

The app is `make_celery` on the embedded defaults; each plain function is replaced by a
recorder, so no engine, broker or listing runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError, TransientError
from kiln.app.dispatch import contract
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.workers.celery import inflight
from kiln.workers.celery.app import KilnCelery, make_celery
from kiln.workers.chunk import run as chunk_run
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.jobs import ingest, periodic
from kiln.workers.jobs.ingest import StepReport
from tests.support import migrated_settings

TASKS = (
    contract.CHUNK_TASK,
    contract.INGEST_TASK,
    contract.RECONCILE_TASK,
    contract.SCHEDULES_TASK,
    contract.WEBHOOKS_TASK,
)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(tmp_path, monkeypatch, redispatch_after_s=42)


@pytest.fixture
def runtime(settings: Settings) -> SimpleNamespace:
    """Stands in for the worker runtime: the adapters only pass it on (and read settings)."""
    return SimpleNamespace(settings=settings)


class Courier:
    """Stands in for the webhook courier: counts its wakes."""

    def __init__(self) -> None:
        self.wakes = 0

    def wake(self) -> None:
        self.wakes += 1

    def stop(self) -> None:
        pass


@pytest.fixture
def courier() -> Courier:
    return Courier()


@pytest.fixture
def app(settings: Settings, runtime: SimpleNamespace, courier: Courier) -> Iterator[KilnCelery]:
    celery = make_celery(settings)
    celery._runtime = runtime  # type: ignore[assignment]  # what `app.runtime()` hands out
    celery._courier = courier  # type: ignore[assignment]  # what `app.courier()` hands out
    yield celery
    celery._runtime = None
    celery._courier = None
    celery.close()


class Recorder:
    """A plain function's stand-in: keeps each call's arguments, answers `result` (or raises
    the errors in `raises`, one per call, first)."""

    def __init__(self, result: Any, raises: list[Exception] | None = None) -> None:
        self.result, self.raises = result, list(raises or [])
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        if self.raises:
            raise self.raises.pop(0)
        return self.result


def run_task(app: KilnCelery, name: str, *args: Any, queue: str | None = None) -> Any:
    """Run a task's body as a worker would, on a message from `queue`."""
    task = app.tasks[name]
    task.push_request(delivery_info={"routing_key": queue} if queue else {})
    try:
        return task.run(*args)
    finally:
        task.pop_request()


def _report(job_id: str) -> ChunkReport:
    return ChunkReport(job_id, 1, processed=3, succeeded=2, failed=1, job_status="completed")


@pytest.mark.parametrize(("queue", "urgent"), [("interactive", True), ("bulk", False)])
def test_the_chunk_task_runs_process_chunk(
    app: KilnCelery,
    runtime: SimpleNamespace,
    monkeypatch: pytest.MonkeyPatch,
    queue: str,
    urgent: bool,
) -> None:
    recorder = Recorder(_report("job-1"))
    monkeypatch.setattr(chunk_run, "process_chunk", recorder)

    answer = run_task(app, contract.CHUNK_TASK, "job-1", 1, [7, 8, 9], queue=queue)

    [(args, kwargs)] = recorder.calls
    assert args == (runtime, "job-1", 1, [7, 8, 9]) and kwargs["urgent"] is urgent
    assert isinstance(kwargs["dispatcher"], CeleryDispatcher)  # a video's frame chunks go out
    assert answer == {"processed": 3, "job_status": "completed"}


def test_a_chunk_that_closes_its_job_wakes_the_webhook_courier(
    app: KilnCelery, courier: Courier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its delivery is due at once: this worker sends it without waiting for beat's sweep."""
    open_still = ChunkReport("job-1", 1, processed=3, succeeded=3, failed=0, job_status=None)
    monkeypatch.setattr(chunk_run, "process_chunk", Recorder(open_still))
    run_task(app, contract.CHUNK_TASK, "job-1", 1, [7], queue="bulk")
    assert courier.wakes == 0
    monkeypatch.setattr(chunk_run, "process_chunk", Recorder(_report("job-1")))
    run_task(app, contract.CHUNK_TASK, "job-1", 2, [8], queue="bulk")
    assert courier.wakes == 1


def test_beat_s_webhook_sweep_wakes_the_courier_and_returns(
    app: KilnCelery, courier: Courier
) -> None:
    assert run_task(app, contract.WEBHOOKS_TASK) == {"woken": True}
    assert courier.wakes == 1
    schedule = app.conf.beat_schedule["kiln-webhooks"]
    assert schedule["task"] == contract.WEBHOOKS_TASK
    assert schedule["options"]["queue"] == contract.CONTROL


def test_the_ingest_task_runs_a_step_that_sends_through_this_app(
    app: KilnCelery, runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(StepReport("job-1", "continue", pages=2, listed=40, queued=5))
    monkeypatch.setattr(ingest, "ingest_step", recorder)

    answer = run_task(app, contract.INGEST_TASK, "job-1", "step-1", queue="ingest")

    [(args, kwargs)] = recorder.calls
    assert (args[0], args[2:], kwargs) == (runtime, ("job-1", "step-1"), {})
    assert isinstance(args[1], CeleryDispatcher) and args[1].app is app
    assert answer == {"outcome": "continue", "listed": 40}


def test_the_reconcile_task_reads_the_broker_with_the_redispatch_grace(
    app: KilnCelery, runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder({"ingests_resumed": 0, "chunks_expired": 0, "chunks_resent": 1})
    monkeypatch.setattr(periodic, "reconcile", recorder)
    reads = Recorder({("job-1", 0)})
    monkeypatch.setattr(inflight, "chunks_in_flight", reads)

    answer = run_task(app, contract.RECONCILE_TASK)

    [(args, _kwargs)] = recorder.calls
    assert args[0] is runtime
    assert isinstance(args[1], CeleryDispatcher) and args[1].app is app
    assert reads.calls == []  # the broker is read only when the reconciler asks
    assert args[2]() == {("job-1", 0)}
    assert reads.calls == [((app, contract.QUEUES, contract.CHUNK_TASK, 42), {})]
    assert answer == {"ingests_resumed": 0, "chunks_expired": 0, "chunks_resent": 1}


def test_the_schedules_task_runs_the_due_schedules(
    app: KilnCelery, runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder({"started": 2})
    monkeypatch.setattr(periodic, "run_due_schedules", recorder)

    assert run_task(app, contract.SCHEDULES_TASK) == {"started": 2}

    [((given, dispatcher), _kwargs)] = recorder.calls
    assert given is runtime and isinstance(dispatcher, CeleryDispatcher)


def test_every_task_of_the_contract_is_registered_with_retries(app: KilnCelery) -> None:
    for name in TASKS:
        task = app.tasks[name]
        assert task.name == name
        assert set(task.autoretry_for) == {TransientError, OperationalError}, name
        assert (task.max_retries, task.retry_backoff, task.retry_jitter) == (8, 2, True), name


def test_what_the_producer_sends_is_what_the_tasks_take(
    app: KilnCelery, runtime: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API sends by name with positional ids (app/dispatch/producer.py); each message,
    delivered as sent, reaches the plain function whole."""
    sent: list[dict[str, Any]] = []
    outbox = SimpleNamespace(send_task=lambda name, args, **options: sent.append(
        {"name": name, "args": args, **options}
    ))  # fmt: skip
    producer = CeleryDispatcher(outbox)  # type: ignore[arg-type]
    producer.enqueue_chunk("job-1", 2, [5, 6], contract.BULK)
    producer.enqueue_ingest("job-1", "step-3", countdown=2.0)
    chunks = Recorder(_report("job-1"))
    steps = Recorder(StepReport("job-1", "done"))
    monkeypatch.setattr(chunk_run, "process_chunk", chunks)
    monkeypatch.setattr(ingest, "ingest_step", steps)

    for message in sent:
        run_task(app, message["name"], *message["args"], queue=message["queue"])

    assert [m["name"] for m in sent] == [contract.CHUNK_TASK, contract.INGEST_TASK]
    assert [m["queue"] for m in sent] == [contract.BULK, contract.INGEST]
    [(args, kwargs)] = chunks.calls
    assert args == (runtime, "job-1", 2, [5, 6]) and kwargs["urgent"] is False
    assert steps.calls[0][0][2:] == ("job-1", "step-3")


def test_a_transient_error_is_retried(app: KilnCelery, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder(_report("job-1"), raises=[TransientError("S3 is throttling requests.")])
    monkeypatch.setattr(chunk_run, "process_chunk", recorder)

    result = app.tasks[contract.CHUNK_TASK].apply(args=["job-1", 1, [7]])  # eager: retries run

    # `.result`, not `.get()`: an embedded worker earlier in the session marks joins as blocking.
    assert result.successful() and result.result == {"processed": 3, "job_status": "completed"}
    assert len(recorder.calls) == 2


def test_an_error_in_the_input_is_not_retried(
    app: KilnCelery, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(None, raises=[InputError("The bucket 'x' does not exist.")])
    monkeypatch.setattr(ingest, "ingest_step", recorder)

    result = app.tasks[contract.INGEST_TASK].apply(args=["job-1", None])

    assert result.failed() and isinstance(result.result, InputError)
    assert len(recorder.calls) == 1
