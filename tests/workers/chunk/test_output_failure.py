"""A chunk whose shard its job's output refuses for good (moto's in-process S3, with the
output bucket missing): the job fails at once with the output's sentence, every open item
with it, and no chunk of it runs inference again — nor does the reconciler send one. And a
shard write that fails for a while: the items keep the reason, and an item given up on says
it, without the shard having been written."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from moto import mock_aws
from sqlalchemy import update

from kiln.app.core.errors import TransientError
from kiln.app.db.leases import gave_up
from kiln.app.db.models import ItemStatus, Job, JobStatus
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.results import results
from kiln.workers.chunk import infer
from kiln.workers.chunk.run import process_chunk
from kiln.workers.jobs.periodic import reconcile
from kiln.workers.runtime import WorkerRuntime
from tests.workers.chunk.test_run import items_by_key, job_row, submit

OUTPUT = "s3://no-such-results/detector/"
SENTENCE = (
    "The output bucket 'no-such-results' does not exist (s3://no-such-results/detector/): "
    "create it or name another --output."
)


@pytest.fixture
def s3(runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """moto's S3 behind the runtime's outputs (no bucket made)."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        monkeypatch.setattr(
            runtime,
            "place",
            lambda job_id, output: results.place_for(runtime.store, job_id, output, lambda: client),
        )
        yield client


def with_output(runtime: WorkerRuntime, job_id: str, output: str) -> None:
    with runtime.sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(output=output))
        session.commit()


def test_an_output_that_refuses_its_shard_fails_the_job_at_once(
    runtime: WorkerRuntime, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, calls = submit(runtime)  # two chunks: 3 items, then 2
    with_output(runtime, job_id, OUTPUT)

    first = process_chunk(runtime, job_id, 0, calls[0].item_ids)  # returns: nothing to retry
    assert first.job_status == JobStatus.FAILED
    job = job_row(runtime, job_id)
    assert (job.status, job.error) == (JobStatus.FAILED, SENTENCE)
    items = items_by_key(runtime, job_id)
    assert {i.status for i in items.values()} == {ItemStatus.FAILED}
    assert {i.error for i in items.values()} == {SENTENCE}  # the output named, each item
    assert {k: i.attempts for k, i in items.items()} == {
        "r.png": 1, "g.png": 1, "b.png": 1, "notes.txt": 0, "b2.png": 0
    }  # fmt: skip

    inferred: list[int] = []
    answer = infer.answer_chunk
    monkeypatch.setattr(
        "kiln.workers.chunk.run.answer_chunk",
        lambda *args: inferred.append(1) or answer(*args),
    )
    second = process_chunk(runtime, job_id, 1, calls[1].item_ids)  # still queued: it stops
    assert (second.processed, second.job_status, inferred) == (0, None, [])
    assert {i.attempts for i in items_by_key(runtime, job_id).values()} <= {0, 1}

    dispatcher = RecordingDispatcher()
    done = reconcile(runtime, dispatcher, lambda: set())
    assert (done["chunks_resent"], done["jobs_closed"], dispatcher.calls) == (0, 0, [])
    assert job_row(runtime, job_id).error == SENTENCE


def test_a_shard_write_that_keeps_failing_is_recorded_on_the_items(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, calls = submit(runtime)

    def unreachable(*_args: Any) -> str:
        raise TransientError("Could not reach S3 for s3://out/x: timed out.")

    monkeypatch.setattr(results, "write_table", unreachable)
    runtime.settings.max_attempts = 2
    for attempt in (1, 2):
        with pytest.raises(TransientError):  # the task retries it
            process_chunk(runtime, job_id, 0, calls[0].item_ids)
        chunk = [items_by_key(runtime, job_id)[k] for k in ("r.png", "g.png", "b.png")]
        assert {(i.status, i.attempts) for i in chunk} == {(ItemStatus.PENDING, attempt)}
        assert {i.error for i in chunk} == {"Could not reach S3 for s3://out/x: timed out."}

    with pytest.raises(TransientError):  # the give-up is recorded; the shard still fails
        process_chunk(runtime, job_id, 0, calls[0].item_ids)
    chunk = [items_by_key(runtime, job_id)[k] for k in ("r.png", "g.png", "b.png")]
    assert {(i.status, i.attempts) for i in chunk} == {(ItemStatus.FAILED, 2)}
    assert {i.error for i in chunk} == {
        f"{gave_up(2)} The last error recorded: Could not reach S3 for s3://out/x: timed out."
    }

    monkeypatch.undo()  # S3 is back: the shard of the given-up items is written
    process_chunk(runtime, job_id, 0, calls[0].item_ids)
    assert process_chunk(runtime, job_id, 1, calls[1].item_ids).job_status == JobStatus.COMPLETED
    assert max(i.attempts for i in items_by_key(runtime, job_id).values()) == 2
