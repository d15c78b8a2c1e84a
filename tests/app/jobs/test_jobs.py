"""`submit_job`, `cancel_job`, `progress`: the service layer on SQLite and a local store."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from devstack.images import solid
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db import chunk_runs, counters
from kiln.app.db.chunk_runs import RunTally
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.dispatch.stub import BrokenDispatcher, Enqueued, RecordingDispatcher
from kiln.app.jobs import jobs as jobs_module
from kiln.app.jobs.jobs import (
    INTERACTIVE_MAX_ITEMS,
    InputRef,
    JobRequest,
    LeaseTiming,
    Submitted,
    Upload,
    cancel_job,
    get_job,
    progress,
    submit_job,
)
from kiln.app.storage.local import LocalStore
from kiln.app.tenants.tenants import allow_bucket
from tests.app.conftest import CHUNK_SIZE


@pytest.fixture(autouse=True)
def _acme_reads_test_buckets(session: Session) -> None:
    """The S3 inputs below name these buckets; tests/app/tenants/test_tenants.py covers refusals."""
    for bucket in ("photos", "bucket"):
        allow_bucket(session, "acme", bucket)
    session.commit()


def uploads(n: int, prefix: str = "img") -> list[Upload]:
    return [
        Upload(f"{prefix}-{i}.png", solid((i * 30 % 256, 10, 200)), "image/png") for i in range(n)
    ]


def submit(
    session: Session,
    store: LocalStore,
    dispatcher: object,
    settings: Settings,
    *,
    n: int = 2,
    tenant: str = "acme",
    model: str = "detector",
    key: str | None = None,
) -> Submitted:
    request = JobRequest(tenant=tenant, model=model, uploads=uploads(n), idempotency_key=key)
    return submit_job(session, store, dispatcher, settings, request)  # type: ignore[arg-type]


def items_of(session: Session, job_id: str) -> list[Item]:
    return list(session.scalars(select(Item).where(Item.job_id == job_id).order_by(Item.id)))


def job_count(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Job)) or 0)


# --- submit -------------------------------------------------------------------------------


def test_submit_records_items_and_enqueues_one_message_per_chunk(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    assert settings.chunk_size == CHUNK_SIZE == 3
    submitted = submit(session, store, dispatcher, settings, n=7)

    assert submitted.created is True
    job = submitted.job
    assert job.status == JobStatus.QUEUED
    assert job.tenant == "acme" and job.model == "detector"
    assert job.chunk_count == 3
    items = items_of(session, job.id)
    assert [i.key for i in items] == [f"img-{i}.png" for i in range(7)]
    assert [i.chunk for i in items] == [0, 0, 0, 1, 1, 1, 2]
    assert {i.status for i in items} == {ItemStatus.PENDING}
    assert {i.attempts for i in items} == {0}
    ids = [i.id for i in items]
    assert dispatcher.calls == [
        Enqueued(job.id, 0, ids[0:3], "interactive"),
        Enqueued(job.id, 1, ids[3:6], "interactive"),
        Enqueued(job.id, 2, ids[6:7], "interactive"),
    ]


def test_large_jobs_go_to_the_bulk_queue(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    roomy = settings.model_copy(
        update={"max_files_per_job": 1000, "chunk_size": 10, "bulk_chunk_size": 100}
    )
    inputs = [InputRef(uri=f"s3://photos/{i:04d}.jpg") for i in range(INTERACTIVE_MAX_ITEMS + 1)]
    job = submit_job(
        session, store, dispatcher, roomy, JobRequest("acme", "detector", inputs=inputs)
    ).job
    assert job.chunk_count == 3
    assert [(c.chunk, len(c.item_ids), c.queue) for c in dispatcher.calls] == [
        (0, 100, "bulk"),
        (1, 100, "bulk"),
        (2, INTERACTIVE_MAX_ITEMS + 1 - 200, "bulk"),
    ]


def test_a_job_of_exactly_the_interactive_limit_stays_interactive(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    roomy = settings.model_copy(update={"max_files_per_job": 1000, "chunk_size": 100})
    inputs = [InputRef(uri=f"s3://photos/{i:04d}.jpg") for i in range(INTERACTIVE_MAX_ITEMS)]
    submit_job(session, store, dispatcher, roomy, JobRequest("acme", "detector", inputs=inputs))
    assert {c.queue for c in dispatcher.calls} == {"interactive"}


def test_uploads_are_stored_before_submit_returns(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(tenant="acme", model="detector", uploads=uploads(4))
    job = submit_job(session, store, dispatcher, settings, request).job

    items = items_of(session, job.id)
    for index, (upload, item) in enumerate(zip(request.uploads, items, strict=True)):
        key = f"jobs/{job.id}/inputs/{index:06d}"
        assert item.source == f"store:{key}"
        assert store.get(key) == upload.data
    assert sorted(store.list(f"jobs/{job.id}/inputs/")) == [
        f"jobs/{job.id}/inputs/{i:06d}" for i in range(4)
    ]


def test_chunks_are_enqueued_after_the_job_is_committed(
    sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    """A worker that picks a message up at once must find the items and their bytes."""
    seen: list[tuple[int, bool]] = []

    class Checking:
        def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
            with sessions() as other:  # another connection sees only committed rows
                found = items_of(other, job_id)
            wanted = [i for i in found if i.id in item_ids]
            assert len(wanted) == len(item_ids)
            stored = all(store.exists((i.source or "").removeprefix("store:")) for i in wanted)
            seen.append((chunk, stored))

    with sessions() as session:
        submit(session, store, Checking(), settings, n=4)
    assert seen == [(0, True), (1, True)]


def test_text_inputs_become_items_without_stored_bytes(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(
        tenant="acme", model="detector", inputs=[InputRef(uri="s3://bucket/a.jpg")]
    )
    job = submit_job(session, store, dispatcher, settings, request).job
    [item] = items_of(session, job.id)
    assert item.key == "s3://bucket/a.jpg" and item.source == "s3://bucket/a.jpg"
    assert list(store.list(f"jobs/{job.id}/")) == []


def test_local_files_are_refused_from_the_api(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(
        tenant="acme", model="detector", inputs=[InputRef(uri="file:///etc/passwd")]
    )
    with pytest.raises(InputError, match="is not an S3 URI"):
        submit_job(session, store, dispatcher, settings, request)
    assert job_count(session) == 0


def test_kiln_run_names_local_files_by_their_key(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    ref = InputRef(uri="file:///photos/sub/a.jpg", key="sub/a.jpg")
    request = JobRequest(tenant="local", model="detector", inputs=[ref], local_files=True)
    job = submit_job(session, store, dispatcher, settings, request).job
    [item] = items_of(session, job.id)
    assert (item.key, item.source) == ("sub/a.jpg", "file:///photos/sub/a.jpg")


def test_idempotency_key_returns_the_same_job_and_enqueues_nothing_again(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    first = submit(session, store, dispatcher, settings, n=4, key="batch-1")
    calls = list(dispatcher.calls)
    assert len(calls) == 2

    again = submit(session, store, dispatcher, settings, n=4, key="batch-1")
    assert again.created is False
    assert again.job.id == first.job.id
    assert dispatcher.calls == calls
    assert job_count(session) == 1
    assert len(items_of(session, first.job.id)) == 4


def test_idempotency_keys_are_per_tenant(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    mine = submit(session, store, dispatcher, settings, key="k", tenant="acme")
    theirs = submit(session, store, dispatcher, settings, key="k", tenant="globex")
    assert theirs.created is True
    assert theirs.job.id != mine.job.id


def test_unknown_model_is_an_input_error_listing_the_available_models(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    with pytest.raises(InputError, match="no model named 'nope'") as caught:
        submit(session, store, dispatcher, settings, model="nope")
    assert "available models: detector, ocr" in str(caught.value)
    assert dispatcher.calls == []
    assert job_count(session) == 0


def test_duplicate_names_are_an_input_error_and_store_nothing(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    twice = [Upload("same.png", b"one"), Upload("same.png", b"two")]
    request = JobRequest(tenant="acme", model="detector", uploads=twice)
    with pytest.raises(InputError, match=re.escape("share the name 'same.png'")):
        submit_job(session, store, dispatcher, settings, request)
    assert list(store.list("jobs/")) == []
    assert job_count(session) == 0
    assert dispatcher.calls == []


def test_upload_without_a_filename_is_an_input_error(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(tenant="acme", model="detector", uploads=[Upload("", b"x")])
    with pytest.raises(InputError, match="needs a filename"):
        submit_job(session, store, dispatcher, settings, request)


def test_text_for_an_image_model_is_an_input_error(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(tenant="acme", model="ocr", inputs=[InputRef(text="hello")])
    with pytest.raises(InputError, match="'ocr' takes images, not text"):
        submit_job(session, store, dispatcher, settings, request)
    assert job_count(session) == 0


@pytest.mark.parametrize(
    "ref",
    [InputRef(), InputRef(uri="s3://b/k", text="both")],
    ids=["neither", "both"],
)
def test_an_input_needs_exactly_one_of_uri_or_text(
    session: Session,
    store: LocalStore,
    dispatcher: RecordingDispatcher,
    settings: Settings,
    ref: InputRef,
) -> None:
    request = JobRequest(tenant="acme", model="detector", inputs=[ref])
    with pytest.raises(InputError, match='exactly one of "uri" or "text"'):
        submit_job(session, store, dispatcher, settings, request)


def test_too_many_inputs_is_an_input_error(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    assert settings.max_files_per_job == 10
    with pytest.raises(InputError, match="at most 10 inputs; this one has 11"):
        submit(session, store, dispatcher, settings, n=11)
    assert list(store.list("jobs/")) == []
    assert job_count(session) == 0


def test_exactly_the_maximum_is_accepted(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings, n=10).job
    assert len(items_of(session, job.id)) == 10


def test_a_job_needs_an_input(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    with pytest.raises(InputError, match="at least one input"):
        submit(session, store, dispatcher, settings, n=0)


def test_an_unreachable_broker_fails_the_job_with_a_sentence(
    sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    with sessions() as session, pytest.raises(TransientError, match="could not be queued"):
        submit(session, store, BrokenDispatcher(), settings, n=4)

    with sessions() as session:  # what a later request sees
        [job] = session.scalars(select(Job)).all()
        assert job.status == JobStatus.FAILED
        assert job.error == "Kiln could not reach its queue."
        assert job.finished_at is not None
        # a closed job holds no pending item: each failed, with the same sentence
        items = items_of(session, job.id)
        assert {(i.status, i.error) for i in items} == {
            (ItemStatus.FAILED, "Kiln could not reach its queue.")
        }
        tally = counters.read(session, job.id)
        assert (tally.total, tally.failed, tally.open) == (4, 4, 0)
        assert counters.difference(session, job.id) == counters.Tally()  # kept, not drifted


# --- cancel -------------------------------------------------------------------------------


def test_cancel_a_queued_job_cancels_every_item_and_the_job(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings, n=4).job

    cancelled = cancel_job(session, "acme", job.id)

    assert cancelled.status == JobStatus.CANCELLED
    assert cancelled.finished_at is not None
    items = items_of(session, job.id)
    assert {i.status for i in items} == {ItemStatus.CANCELLED}
    assert {i.error for i in items} == {"The job was cancelled."}


def test_cancel_keeps_finished_items_and_waits_for_running_ones(
    sessions: sessionmaker[Session],
    store: LocalStore,
    dispatcher: RecordingDispatcher,
    settings: Settings,
) -> None:
    with sessions() as session:
        job = submit(session, store, dispatcher, settings, n=4).job
        ids = [i.id for i in items_of(session, job.id)]
        session.execute(update(Item).where(Item.id == ids[0]).values(status=ItemStatus.SUCCEEDED))
        session.execute(update(Item).where(Item.id == ids[1]).values(status=ItemStatus.RUNNING))
        session.commit()

        cancelling = cancel_job(session, "acme", job.id)
        assert cancelling.status == JobStatus.CANCELLING
        assert cancelling.finished_at is None

    with sessions() as session:
        statuses = [i.status for i in items_of(session, job.id)]
        assert statuses == [
            ItemStatus.SUCCEEDED,
            ItemStatus.RUNNING,
            ItemStatus.CANCELLED,
            ItemStatus.CANCELLED,
        ]
        assert get_job(session, "acme", job.id).status == JobStatus.CANCELLING


def test_cancelling_twice_is_a_conflict(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings).job
    cancel_job(session, "acme", job.id)
    with pytest.raises(ConflictError, match="already cancelled"):
        cancel_job(session, "acme", job.id)


def test_cancelling_a_failed_job_is_a_conflict(
    sessions: sessionmaker[Session], store: LocalStore, settings: Settings
) -> None:
    with sessions() as session, pytest.raises(TransientError):
        submit(session, store, BrokenDispatcher(), settings)
    with sessions() as session:
        job_id = session.scalars(select(Job.id)).one()
        with pytest.raises(ConflictError, match="already failed"):
            cancel_job(session, "acme", job_id)


def test_another_tenant_cannot_see_or_cancel_the_job(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings).job
    with pytest.raises(NotFoundError, match=f"There is no job {job.id}"):
        cancel_job(session, "globex", job.id)
    with pytest.raises(NotFoundError):
        get_job(session, "globex", job.id)
    assert get_job(session, "acme", job.id).status == JobStatus.QUEUED
    assert {i.status for i in items_of(session, job.id)} == {ItemStatus.PENDING}


def test_cancel_an_unknown_job_is_not_found(session: Session) -> None:
    with pytest.raises(NotFoundError):
        cancel_job(session, "acme", "00000000-0000-0000-0000-000000000000")


# --- progress -----------------------------------------------------------------------------

TIMING = LeaseTiming(lease_s=60.0, renew_s=3.0)


def test_progress_of_a_queued_job(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings, n=5).job
    report = progress(session, job, TIMING)
    assert report.counts.total == 5
    assert report.counts.pending == 5
    assert report.counts.done == 0
    assert report.items_per_second is None
    assert report.started_at is None and report.finished_at is None
    assert report.created_at.tzinfo is not None


def test_progress_counts_and_rate(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings, n=5).job
    ids = [i.id for i in items_of(session, job.id)]
    for item_id, status in zip(
        ids,
        [ItemStatus.SUCCEEDED, ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.RUNNING],
        strict=False,
    ):
        session.execute(update(Item).where(Item.id == item_id).values(status=status))
    counters.repair(session, job.id)  # the edits above bypass the counters
    started = utcnow() - timedelta(seconds=30)
    job.status, job.started_at, job.finished_at = (
        JobStatus.RUNNING,
        started,
        started + timedelta(seconds=10),
    )
    session.commit()
    session.expire_all()  # read back what SQLite stored (naive datetimes)

    job = get_job(session, "acme", job.id)
    report = progress(session, job, TIMING)
    assert (report.counts.total, report.counts.succeeded, report.counts.failed) == (5, 2, 1)
    assert report.counts.pending == 2  # one running, one pending
    assert report.items_per_second == pytest.approx(0.3)  # 3 finished in 10 s
    assert report.started_at is not None and report.started_at.tzinfo is not None
    assert report.finished_at is not None
    assert report.finished_at - report.started_at == timedelta(seconds=10)


def test_progress_of_a_running_job_counts_its_last_minute(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    """An open job's rate is over its last minute (so the ETA does not swing with the start
    of the job), and what runs now is counted apart from what waits."""
    job = submit(session, store, dispatcher, settings, n=8).job
    ids = [i.id for i in items_of(session, job.id)]
    now = utcnow()
    for item_id, ago in zip(ids[:4], (90, 30, 20, 10), strict=True):
        finished = now - timedelta(seconds=ago)
        session.execute(
            update(Item)
            .where(Item.id == item_id)
            .values(status=ItemStatus.SUCCEEDED, finished_at=finished)
        )
    fresh = now + timedelta(seconds=TIMING.lease_s)  # renewed just now
    session.execute(
        update(Item)
        .where(Item.id.in_(ids[4:6]))
        .values(status=ItemStatus.RUNNING, lease_owner="run", lease_expires_at=fresh)
    )
    counters.repair(session, job.id)  # the edits above bypass the counters
    job.status, job.started_at = JobStatus.RUNNING, now - timedelta(seconds=100)
    session.commit()

    report = progress(session, job, TIMING)
    assert report.items_per_second == pytest.approx(3 / 60, abs=0.01)  # 3 in the last minute
    assert (report.running, report.waiting, report.counts.pending) == (2, 2, 4)
    assert report.eta_seconds == pytest.approx(4 / report.items_per_second, rel=0.01)
    assert report.stalled_since is None


def test_progress_says_since_when_a_worker_stopped_renewing(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    job = submit(session, store, dispatcher, settings, n=3).job
    ids = [i.id for i in items_of(session, job.id)]
    last_renewed = utcnow() - timedelta(seconds=TIMING.stale_s + 5)
    expires = last_renewed + timedelta(seconds=TIMING.lease_s)  # not yet run out
    session.execute(
        update(Item)
        .where(Item.id.in_(ids[:2]))
        .values(status=ItemStatus.RUNNING, lease_owner="dead", lease_expires_at=expires)
    )
    counters.repair(session, job.id)
    job.status, job.started_at = JobStatus.RUNNING, utcnow() - timedelta(seconds=60)
    session.commit()

    report = progress(session, job, TIMING)
    assert report.running == 2
    assert report.stalled_since is not None
    assert abs((report.stalled_since - last_renewed).total_seconds()) < 1
    assert report.eta_seconds is None  # what waits on the reconciler has no ETA


def test_a_running_jobs_rate_counts_written_rows_and_spreads_runs_still_going(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    """Over the last minute: the rows written in it (a count: read on every poll), and a run
    still going counts the rows it answered spread from its start to now — so its write moves
    them from one to the other without a step."""
    job = submit(session, store, dispatcher, settings, n=10).job
    ids = [i.id for i in items_of(session, job.id)]
    now = utcnow()
    session.execute(
        update(Item)
        .where(Item.id.in_(ids[:6]))
        .values(
            status=ItemStatus.SUCCEEDED,
            started_at=now - timedelta(seconds=100),
            finished_at=now - timedelta(seconds=40),
        )
    )
    fresh = now + timedelta(seconds=TIMING.lease_s)
    session.execute(
        update(Item)
        .where(Item.id.in_(ids[6:]))
        .values(status=ItemStatus.RUNNING, lease_owner="run", lease_expires_at=fresh)
    )
    chunk_runs.publish(session, [RunTally("run", job.id, 3, now - timedelta(seconds=30))])
    counters.repair(session, job.id)  # the edits above bypass the counters
    job.status, job.started_at = JobStatus.RUNNING, now - timedelta(seconds=100)
    session.commit()

    report = progress(session, job, TIMING)
    assert report.items_per_second == pytest.approx((6 + 3) / 60, abs=0.01)
    assert (report.processed, report.answered, report.running) == (9, 3, 4)


def test_a_chunk_written_between_two_reads_is_counted_once(
    session: Session,
    store: LocalStore,
    dispatcher: RecordingDispatcher,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chunk's write moves its rows from its run's answered rows to the counters in one
    transaction; committed after the counters were read and before the runs were, it was in
    neither, and the bar stepped back by a chunk. The counters and the runs' answered rows
    are now read in one statement."""
    job = submit(session, store, dispatcher, settings, n=8).job
    ids = [i.id for i in items_of(session, job.id)]
    fresh = utcnow() + timedelta(seconds=TIMING.lease_s)
    session.execute(
        update(Item)
        .where(Item.id.in_(ids))
        .values(status=ItemStatus.RUNNING, lease_owner="run", lease_expires_at=fresh)
    )
    chunk_runs.publish(session, [RunTally("run", job.id, 5, utcnow() - timedelta(seconds=5))])
    job.status, job.started_at = JobStatus.RUNNING, utcnow() - timedelta(seconds=10)
    session.commit()
    real = jobs_module.queries.job_activity
    writes = []

    def written_meanwhile(*args: object, **kwargs: object) -> object:
        if not writes:  # the run writes its first five rows, once, just before the first read
            writes.append(True)
            finished = update(Item).where(Item.id.in_(ids[:5]))
            session.execute(finished.values(status=ItemStatus.SUCCEEDED, finished_at=utcnow()))
            counters.add(session, job.id, 0, counters.Tally(succeeded=5))
            chunk_runs.forget(session, ["run"])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    before = jobs_module.queries.job_counts(session, job.id, bulk=False)
    monkeypatch.setattr(jobs_module.queries, "job_activity", written_meanwhile)
    report = progress(session, job, TIMING, before)
    assert writes and report.counts.succeeded == 5
    assert report.processed == 5  # not 0: the five are in the counters now


@pytest.mark.parametrize(
    ("model", "options", "sentence"),
    [
        ("phash", {"max_distance": 17}, "from 0 to 16;"),
        ("phash", {"max_distance": "near"}, "whole number"),
        ("phash", {"max_distance": True}, "whole number"),
        ("phash", {"max_distnace": 8}, "no option 'max_distnace'; its options are 'max_distance'"),
        ("detector", {"max_distance": 4}, "no option 'max_distance'; its only option is"),
        ("text-embed", {"group": {"threshold": 0.3}}, "cosine similarity from 0.5 to 1"),
        ("text-embed", {"group": {"treshold": 0.9}}, "no option 'group.treshold'"),
        ("text-embed", {"grup": {}}, "'text-embed' has no option 'grup'"),
    ],
)
def test_bad_options_are_input_errors(
    session: Session,
    store: LocalStore,
    dispatcher: RecordingDispatcher,
    settings: Settings,
    model: str,
    options: dict[str, object],
    sentence: str,
) -> None:
    inputs = [InputRef(text="a")] if model == "text-embed" else []
    request = JobRequest(
        tenant="acme",
        model=model,
        uploads=[] if inputs else uploads(1),
        inputs=inputs,
        options=options,
    )
    with pytest.raises(InputError, match=sentence):
        submit_job(session, store, dispatcher, settings, request)
    assert dispatcher.calls == []


def test_good_options_are_stored_on_the_job(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    request = JobRequest(
        tenant="acme", model="phash", uploads=uploads(1), options={"max_distance": 6}
    )
    assert submit_job(session, store, dispatcher, settings, request).job.options == {
        "max_distance": 6
    }


def test_text_for_the_text_model_and_not_images(
    session: Session, store: LocalStore, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    ok = JobRequest(tenant="acme", model="text-embed", inputs=[InputRef(text="hello")])
    assert submit_job(session, store, dispatcher, settings, ok).job.model == "text-embed"
    with pytest.raises(InputError, match="takes text, not images"):
        submit_job(
            session, store, dispatcher, settings,
            JobRequest(tenant="acme", model="text-embed", inputs=[InputRef(uri="s3://b/a.jpg")]),
        )  # fmt: skip
    with pytest.raises(InputError, match="takes text, not files"):
        submit_job(
            session, store, dispatcher, settings,
            JobRequest(tenant="acme", model="text-embed", uploads=uploads(1)),
        )  # fmt: skip


def test_uploads_of_a_job_the_database_refused_are_removed(
    session: Session,
    store: LocalStore,
    dispatcher: RecordingDispatcher,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*_args: object) -> None:
        raise OperationalError("INSERT INTO items", {}, Exception("the database went away"))

    monkeypatch.setattr(jobs_module, "_insert_job", refuse)
    with pytest.raises(OperationalError):
        submit(session, store, dispatcher, settings, n=3)
    assert list(store.list("jobs/")) == []  # the uploads stored before the insert are gone
    assert dispatcher.calls == []
