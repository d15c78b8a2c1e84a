"""The ingest step on SQLite and moto's in-process S3: pages become items and chunks, each page
one unit of work whose chunk messages follow its commit; a step that loses its claim, or whose
job is cancelled, stops; a bucket that does not exist fails the job with a sentence. A step
pauses while its job has enough chunks outstanding; a new step resumes after the last committed
key, sending first the chunks committed but never sent; only keys the filters take are items
(in any case unless asked), those left out counted; a pipeline's rerun keeps its known failures
unless asked to retry them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.db import ingest as ingest_db
from kiln.app.db.models import Ingest, Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.dispatch.stub import IngestStep, RecordingDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.jobs.jobs import cancel_job
from kiln.app.tenants.tenants import allow_bucket
from kiln.workers.jobs.ingest import BACKPRESSURE_PAUSE_S, StepReport, ingest_step
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings

BUCKET = "photos"
KEYS = [f"2026/{name}.jpg" for name in "abcde"]  # pages of 2: [a b] [c d] [e]


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    return migrated_settings(
        tmp_path,
        monkeypatch,
        chunk_size=3,
        bulk_chunk_size=3,
        ingest_page_size=2,
        ingest_pages_per_step=2,
    )


@pytest.fixture
def runtime(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerRuntime]:
    """A worker runtime whose S3 is moto's, holding `KEYS` in `BUCKET`."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, "testing")
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for key in KEYS:
            s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
        runtime = WorkerRuntime(settings)
        try:
            yield runtime
        finally:
            runtime.close()


class CheckingDispatcher(RecordingDispatcher):
    """Records, and checks that a chunk's items are committed when its message is sent."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        super().__init__()
        self.runtime = runtime

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        with self.runtime.sessions() as other:
            seen = other.scalars(select(Item.id).where(Item.id.in_(item_ids))).all()
        assert sorted(seen) == sorted(item_ids), "a chunk message named uncommitted items"
        super().enqueue_chunk(job_id, chunk, item_ids, queue)


def submit(runtime: WorkerRuntime, source: str = f"s3://{BUCKET}/2026/") -> str:
    with runtime.sessions() as session:
        allow_bucket(session, "acme", source)
        request = BulkRequest("acme", "phash", Source(source))
        return submit_bulk(session, RecordingDispatcher(), request).job.id


def ingest_of(runtime: WorkerRuntime, job_id: str) -> Ingest:
    with runtime.sessions() as session:
        found = session.get(Ingest, job_id)
    assert found is not None
    return found


def job_of(runtime: WorkerRuntime, job_id: str) -> Job:
    with runtime.sessions() as session:
        found = session.get(Job, job_id)
    assert found is not None
    return found


def outcome(report: StepReport) -> tuple[str, int, int, int]:
    return report.outcome, report.pages, report.listed, report.queued


def test_steps_list_pages_into_items_and_send_each_chunk_after_its_commit(
    runtime: WorkerRuntime,
) -> None:
    job_id = submit(runtime)
    dispatcher = CheckingDispatcher(runtime)
    first = ingest_step(runtime, dispatcher, job_id, "step-1")
    assert outcome(first) == ("continue", 2, 4, 2)  # a chunk per page: [a b] and [c d]
    (successor,) = dispatcher.ingests
    assert (successor.job_id, successor.owner, successor.countdown) == (job_id, "step-1", 0)
    assert ingest_of(runtime, job_id).cursor == KEYS[3]

    last = ingest_step(runtime, dispatcher, job_id, successor.owner)
    assert outcome(last) == ("done", 1, 1, 1)
    assert [c.chunk for c in dispatcher.calls] == [0, 1, 2]
    with runtime.sessions() as session:
        keys = session.scalars(select(Item.key).where(Item.job_id == job_id).order_by(Item.id))
        assert list(keys) == KEYS
    ingest = ingest_of(runtime, job_id)
    assert ingest.done and ingest.chunks_sent == 3 and ingest.pages == 3


def test_a_step_of_a_live_ingest_held_by_another_does_nothing(runtime: WorkerRuntime) -> None:
    job_id = submit(runtime)
    ingest_step(runtime, RecordingDispatcher(), job_id, "step-1")
    dispatcher = RecordingDispatcher()
    assert outcome(ingest_step(runtime, dispatcher, job_id, "intruder")) == ("busy", 0, 0, 0)
    assert dispatcher.calls == [] and dispatcher.ingests == []


def during_listing(runtime: WorkerRuntime, before_page: int, act: Callable[[], None]) -> None:
    """Make the runtime's S3 listing call `act` just before it yields page `before_page` (from
    0): between the step's units of work."""
    client = runtime.fetcher.s3_client()

    class Paginator:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def paginate(self, **params: Any) -> Iterator[dict[str, Any]]:
            for number, page in enumerate(self.inner.paginate(**params)):
                if number == before_page:
                    act()
                yield page

    class Client:
        def get_paginator(self, name: str) -> Paginator:
            return Paginator(client.get_paginator(name))

    runtime.fetcher.s3_client = Client  # type: ignore[method-assign]


def test_a_step_taken_over_between_pages_stops_before_the_next(runtime: WorkerRuntime) -> None:
    job_id = submit(runtime)

    def take_over() -> None:
        with runtime.sessions() as session:
            ingest = session.get(Ingest, job_id)
            assert ingest is not None
            ingest.owner = "step-2"
            session.commit()

    during_listing(runtime, 1, take_over)
    dispatcher = RecordingDispatcher()
    assert outcome(ingest_step(runtime, dispatcher, job_id, "step-1")) == ("busy", 1, 2, 1)
    assert ingest_of(runtime, job_id).cursor == KEYS[1]  # page 2 left to its new owner
    assert [c.chunk for c in dispatcher.calls] == [0] and dispatcher.ingests == []


def test_a_cancelled_job_is_listed_no_further_and_closes(
    runtime: WorkerRuntime, session: Session
) -> None:
    job_id = submit(runtime)
    cancel_job(session, "acme", job_id)
    dispatcher = RecordingDispatcher()
    assert outcome(ingest_step(runtime, dispatcher, job_id, "step-1")) == ("done", 0, 0, 0)
    assert dispatcher.calls == [] and ingest_of(runtime, job_id).done
    assert job_of(runtime, job_id).status == JobStatus.CANCELLED


def test_a_cancel_between_pages_stops_the_listing(runtime: WorkerRuntime) -> None:
    job_id = submit(runtime)

    def cancel() -> None:
        with runtime.sessions() as other:
            cancel_job(other, "acme", job_id)

    during_listing(runtime, 1, cancel)
    dispatcher = RecordingDispatcher()
    assert ingest_step(runtime, dispatcher, job_id, "step-1").outcome == "done"
    assert ingest_of(runtime, job_id).cursor == KEYS[1]  # page 2 was not recorded
    assert [c.chunk for c in dispatcher.calls] == [0] and dispatcher.ingests == []
    assert ingest_of(runtime, job_id).done
    assert job_of(runtime, job_id).status == JobStatus.CANCELLED


def test_a_missing_bucket_fails_the_job_with_a_sentence(runtime: WorkerRuntime) -> None:
    job_id = submit(runtime, "s3://no-such-bucket/x/")
    report = ingest_step(runtime, RecordingDispatcher(), job_id, "step-1")
    assert report.outcome == "failed"
    job = job_of(runtime, job_id)
    assert job.status == JobStatus.FAILED
    assert job.error == "The bucket 'no-such-bucket' does not exist."
    assert ingest_of(runtime, job_id).done


@pytest.fixture
def session(runtime: WorkerRuntime) -> Iterator[Session]:
    with runtime.sessions() as session:
        yield session


# --- backpressure, resuming, filters ------------------------------------------------------


def keys_of(runtime: WorkerRuntime, job_id: str) -> list[str]:
    with runtime.sessions() as session:
        return list(
            session.scalars(select(Item.key).where(Item.job_id == job_id).order_by(Item.id))
        )


def test_a_step_pauses_while_the_job_has_enough_chunks_outstanding(
    runtime: WorkerRuntime, settings: Settings
) -> None:
    job_id = submit(runtime)
    throttled = WorkerRuntime(settings.model_copy(update={"bulk_max_chunks": 1}))
    try:
        dispatcher = RecordingDispatcher()
        report = ingest_step(throttled, dispatcher, job_id, "step-1")
        assert outcome(report) == ("throttled", 1, 2, 1)  # chunk 0 is open: stop after page 1
        assert dispatcher.ingests == [IngestStep(job_id, "step-1", BACKPRESSURE_PAUSE_S)]

        with runtime.sessions() as session:  # chunk 0 has run
            session.execute(update(Item).values(status=ItemStatus.SUCCEEDED))
            session.commit()
        again = ingest_step(throttled, dispatcher, job_id, "step-1")
        assert outcome(again)[:2] == ("throttled", 1)  # one more page, then chunk 1 is open
        assert ingest_of(runtime, job_id).cursor == KEYS[3]
    finally:
        throttled.close()


def test_a_new_step_resumes_after_the_last_committed_key(runtime: WorkerRuntime) -> None:
    """The worker running a step dies after its first page: once its claim is stale, the
    reconciler's new step lists from the cursor on, and every key becomes one item."""
    job_id = submit(runtime)
    died: list[bool] = []

    def die_once() -> None:
        if not died:
            died.append(True)
            raise RuntimeError("the worker was killed")

    during_listing(runtime, 1, die_once)
    first = RecordingDispatcher()
    with pytest.raises(RuntimeError):
        ingest_step(runtime, first, job_id, "step-1")
    assert ingest_of(runtime, job_id).cursor == KEYS[1]
    assert [c.chunk for c in first.calls] == [0]
    assert outcome(ingest_step(runtime, RecordingDispatcher(), job_id, "step-2"))[0] == "busy"

    with runtime.sessions() as session:  # step-1 went silent
        stale = utcnow() - timedelta(seconds=2 * runtime.settings.ingest_stale_s)
        session.execute(update(Ingest).values(heartbeat_at=stale))
        session.commit()
    second = RecordingDispatcher()
    assert outcome(ingest_step(runtime, second, job_id, "step-2")) == ("done", 2, 3, 2)

    assert keys_of(runtime, job_id) == KEYS
    assert [c.chunk for c in second.calls] == [1, 2]  # chunk 0 is not sent twice
    assert ingest_of(runtime, job_id).listed == len(KEYS)


def test_chunks_committed_but_never_sent_go_with_the_next_step(runtime: WorkerRuntime) -> None:
    """The broker refuses a page's chunk after the page committed; the task's retry sends it
    before listing on."""
    job_id = submit(runtime)

    class Refusing(RecordingDispatcher):
        def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
            raise ConnectionError("Connection refused")

    with pytest.raises(ConnectionError):
        ingest_step(runtime, Refusing(), job_id, "step-1")
    assert ingest_of(runtime, job_id).chunks_sent == 0

    retry = RecordingDispatcher()
    assert outcome(ingest_step(runtime, retry, job_id, "step-1")) == ("done", 2, 3, 2)

    assert [c.chunk for c in retry.calls] == [0, 1, 2]
    assert keys_of(runtime, job_id) == KEYS


def test_only_keys_the_filters_take_become_items(runtime: WorkerRuntime) -> None:
    with runtime.sessions() as session:
        allow_bucket(session, "acme", BUCKET)
        source = Source(f"s3://{BUCKET}/2026/", include=("[ace].jpg",), exclude=("e.*",))
        job_id = submit_bulk(
            session, RecordingDispatcher(), BulkRequest("acme", "phash", source)
        ).job.id
    dispatcher = RecordingDispatcher()
    while outcome(ingest_step(runtime, dispatcher, job_id, "step-1"))[0] == "continue":
        pass

    assert keys_of(runtime, job_id) == ["2026/a.jpg", "2026/c.jpg"]
    ingest = ingest_of(runtime, job_id)
    assert (ingest.listed, ingest.excluded) == (2, 3)


def _filtered(runtime: WorkerRuntime, source: Source) -> str:
    with runtime.sessions() as session:
        allow_bucket(session, "acme", BUCKET)
        job_id = submit_bulk(
            session, RecordingDispatcher(), BulkRequest("acme", "phash", source)
        ).job.id
    while outcome(ingest_step(runtime, RecordingDispatcher(), job_id, "step-1"))[0] == "continue":
        pass
    return job_id


def test_a_camera_s_upper_case_names_pass_a_lower_case_glob(runtime: WorkerRuntime) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    for key in ("2026/IMG_0001.JPG", "2026/notes.txt", "2026/folder/"):
        s3.put_object(Bucket=BUCKET, Key=key, Body=b"x")
    glob = ("*.jpg",)

    any_case = _filtered(runtime, Source(f"s3://{BUCKET}/2026/", include=glob))
    assert keys_of(runtime, any_case) == ["2026/IMG_0001.JPG", *KEYS]
    assert ingest_of(runtime, any_case).excluded == 1  # notes.txt; a folder is no object

    strict = _filtered(runtime, Source(f"s3://{BUCKET}/2026/", include=glob, case_sensitive=True))
    assert keys_of(runtime, strict) == KEYS
    assert ingest_of(runtime, strict).excluded == 2


def _pipeline_run(runtime: WorkerRuntime, retry_failed: bool = False) -> str:
    """A run of pipeline `nightly` over the bucket, listed to its end; closed, as if its items
    had run (the next run may start)."""
    with runtime.sessions() as session:
        allow_bucket(session, "acme", BUCKET)
        request = BulkRequest(
            "acme", "phash", Source(f"s3://{BUCKET}/2026/"), pipeline="nightly",
            retry_failed=retry_failed,
        )  # fmt: skip
        job_id = submit_bulk(session, RecordingDispatcher(), request).job.id
    while outcome(ingest_step(runtime, RecordingDispatcher(), job_id, "step-1"))[0] == "continue":
        pass
    with runtime.sessions() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.COMPLETED))
        session.commit()
    return job_id


def test_a_pipeline_s_rerun_keeps_its_known_failures_unless_asked(runtime: WorkerRuntime) -> None:
    first = _pipeline_run(runtime)
    with runtime.sessions() as session:
        job = session.get(Job, first)
        assert job is not None and job.pipeline_id is not None
        ingest_db.mark_done(session, job.pipeline_id, first, job.model, KEYS[:3])
        ingest_db.mark_failed(session, job.pipeline_id, first, job.model, KEYS[3:])
        session.commit()

    again = _pipeline_run(runtime)
    ingest = ingest_of(runtime, again)
    assert (ingest.listed, ingest.skipped, ingest.known_failed) == (5, 3, 2)
    assert keys_of(runtime, again) == []

    retried = _pipeline_run(runtime, retry_failed=True)
    ingest = ingest_of(runtime, retried)
    assert (ingest.skipped, ingest.known_failed) == (3, 0)
    assert keys_of(runtime, retried) == KEYS[3:]
