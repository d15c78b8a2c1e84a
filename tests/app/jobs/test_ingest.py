"""Submitting a bulk job (app/jobs/ingest.py): the source and its filters, the job and its ingest
state, one ingest message after the commit, and pipelines that refuse a second run at once.

The listing itself is the worker's (tests/workers/test_ingest.py)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.app.core.errors import ConflictError, InputError, TransientError
from kiln.app.db.models import Ingest, Job, JobStatus, Pipeline
from kiln.app.dispatch.contract import BULK
from kiln.app.dispatch.stub import BrokenDispatcher, IngestStep, RecordingDispatcher
from kiln.app.jobs.ingest import MAX_PATTERNS, BulkRequest, Source, submit_bulk
from kiln.app.tenants.tenants import allow_bucket

PHOTOS = "s3://photos/2026/"


@pytest.fixture(autouse=True)
def photos_allowed(session: Session) -> None:
    allow_bucket(session, "acme", "photos")


def request(
    source: str | Source = PHOTOS,
    *,
    pipeline: str | None = None,
    output: str | None = None,
    idempotency_key: str | None = None,
) -> BulkRequest:
    source = Source(source) if isinstance(source, str) else source
    return BulkRequest(
        "acme", "phash", source, pipeline=pipeline, output=output, idempotency_key=idempotency_key
    )


def jobs(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Job)) or 0)


# --- the source ---------------------------------------------------------------------------


def test_a_source_without_filters_takes_every_key() -> None:
    source = Source(PHOTOS)
    assert (source.bucket, source.prefix) == ("photos", "2026/")
    assert source.matches("2026/a.jpg") and source.matches("2026/deep/b.png")


def test_filters_match_the_path_below_the_prefix() -> None:
    source = Source(PHOTOS, include=("*.jpg", "raw/*"), exclude=("*-thumb.jpg",))
    assert source.matches("2026/a.jpg")
    assert source.matches("2026/raw/a.cr2")
    assert not source.matches("2026/a.png")
    assert not source.matches("2026/a-thumb.jpg")


@pytest.mark.parametrize(
    "key", ["2026/IMG_0001.JPG", "2026/img_0002.jpg", "2026/Mixed.JpG", "2026/deep/DSC.JPG"]
)
def test_globs_match_in_any_case_by_default(key: str) -> None:
    assert Source(PHOTOS, include=("*.jpg",)).matches(key)
    assert not Source(PHOTOS, exclude=("*.JPG",)).matches(key)


def test_globs_match_in_case_when_asked() -> None:
    source = Source(PHOTOS, include=("*.jpg",), exclude=("TMP/*",), case_sensitive=True)
    assert source.matches("2026/a.jpg")
    assert not source.matches("2026/IMG_0001.JPG")
    assert not source.matches("2026/TMP/a.jpg") and source.matches("2026/tmp/a.jpg")


def test_glob_classes_and_wildcards_keep_their_meaning_in_any_case() -> None:
    source = Source(PHOTOS, include=("[a-c]?.png", "raw/*"))
    assert source.matches("2026/B1.PNG") and source.matches("2026/RAW/x.cr2")
    assert not source.matches("2026/d1.png") and not source.matches("2026/b12.png")


def test_a_source_survives_its_json() -> None:
    source = Source(PHOTOS, include=("*.jpg",), exclude=("tmp/*",))
    assert Source.from_json(source.to_json()) == source
    assert Source.from_json({"s3": PHOTOS}) == Source(PHOTOS)
    strict = Source(PHOTOS, include=("*.jpg",), case_sensitive=True)
    assert Source.from_json(strict.to_json()) == strict


def test_a_source_recorded_before_case_sensitivity_matches_in_any_case() -> None:
    old = Source.from_json({"s3": PHOTOS, "include": ["*.jpg"], "exclude": []})
    assert old == Source(PHOTOS, include=("*.jpg",)) and old.matches("2026/A.JPG")


@pytest.mark.parametrize(
    ("source", "sentence"),
    [
        (Source(PHOTOS, include=("",)), "Include and exclude patterns must not be empty."),
        (
            Source(PHOTOS, include=("*",) * MAX_PATTERNS, exclude=("x",)),
            f"A source takes at most {MAX_PATTERNS} include/exclude patterns.",
        ),
    ],
)
def test_a_bad_source_is_refused_with_a_sentence(source: Source, sentence: str) -> None:
    with pytest.raises(InputError) as refused:
        source.check()
    assert str(refused.value) == sentence


def test_a_source_that_is_not_an_s3_uri_is_refused() -> None:
    with pytest.raises(InputError) as refused:
        Source("/local/folder").check()
    assert str(refused.value).endswith(".")


# --- submitting ---------------------------------------------------------------------------


def test_a_bulk_job_is_recorded_then_its_first_ingest_step_is_sent(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    submitted = submit_bulk(session, dispatcher, request(Source(PHOTOS, include=("*.jpg",))))

    job = submitted.job
    assert submitted.created
    assert (job.status, job.queue, job.chunk_count) == (JobStatus.QUEUED, BULK, 0)
    assert job.model == "phash" and job.tenant == "acme"
    assert job.source == {
        "s3": PHOTOS, "include": ["*.jpg"], "exclude": [], "case_sensitive": False,
    }  # fmt: skip
    ingest = session.get(Ingest, job.id)
    assert ingest is not None and not ingest.done and ingest.cursor is None
    assert not ingest.retry_failed
    assert dispatcher.ingests == [IngestStep(job.id, None, 0)]
    assert dispatcher.calls == []  # chunks come from the listing
    session.rollback()  # what was sent is committed
    assert session.get(Job, job.id) is not None


def test_the_same_idempotency_key_returns_the_first_job(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    first = submit_bulk(session, dispatcher, request(idempotency_key="nightly-1"))
    again = submit_bulk(session, dispatcher, request(idempotency_key="nightly-1"))
    assert (again.job.id, again.created) == (first.job.id, False)
    assert len(dispatcher.ingests) == 1


@pytest.mark.parametrize(
    ("model", "words"),
    [("text-embed", "takes text"), ("no-such-model", "no-such-model")],
)
def test_a_model_that_cannot_read_a_bucket_is_refused(
    session: Session, dispatcher: RecordingDispatcher, model: str, words: str
) -> None:
    with pytest.raises(InputError) as refused:
        submit_bulk(session, dispatcher, BulkRequest("acme", model, Source(PHOTOS)))
    assert words in str(refused.value)
    assert jobs(session) == 0 and dispatcher.ingests == []


def test_a_bad_output_is_refused_before_anything_is_recorded(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    with pytest.raises(InputError):
        submit_bulk(session, dispatcher, request(output="not-a-uri"))
    assert jobs(session) == 0


def test_a_broker_that_refuses_fails_the_job_with_a_sentence(session: Session) -> None:
    with pytest.raises(TransientError):
        submit_bulk(session, BrokenDispatcher(), request())
    job = session.scalars(select(Job)).one()
    assert (job.status, job.error) == (JobStatus.FAILED, "Kiln could not reach its queue.")


# --- pipelines ----------------------------------------------------------------------------


def _close(session: Session, job_id: str) -> None:
    job = session.get(Job, job_id)
    assert job is not None
    job.status = JobStatus.COMPLETED
    session.commit()


def test_a_pipeline_is_made_by_its_first_run_and_reused_by_the_next(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    first = submit_bulk(session, dispatcher, request(pipeline="nightly")).job
    _close(session, first.id)
    second = submit_bulk(session, dispatcher, request(pipeline="nightly")).job

    [pipeline] = session.scalars(select(Pipeline)).all()
    assert (pipeline.name, pipeline.model, pipeline.source["s3"]) == ("nightly", "phash", PHOTOS)
    assert first.pipeline_id == second.pipeline_id == pipeline.id


def test_a_pipeline_runs_once_at_a_time(session: Session, dispatcher: RecordingDispatcher) -> None:
    running = submit_bulk(session, dispatcher, request(pipeline="nightly")).job
    with pytest.raises(ConflictError) as refused:
        submit_bulk(session, dispatcher, request(pipeline="nightly"))
    assert f"still running job {running.id}" in str(refused.value)
    assert jobs(session) == 1


def test_a_pipeline_made_before_case_sensitivity_runs_again_under_its_name(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    first = submit_bulk(session, dispatcher, request(pipeline="nightly")).job
    _close(session, first.id)
    pipeline = session.scalars(select(Pipeline)).one()
    pipeline.source = {"s3": PHOTOS, "include": [], "exclude": []}  # as an older Kiln wrote it
    session.commit()

    again = submit_bulk(session, dispatcher, request(pipeline="nightly")).job
    assert again.pipeline_id == pipeline.id


def test_a_run_asked_to_retry_failures_says_so_in_its_ingest(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    asked = BulkRequest("acme", "phash", Source(PHOTOS), pipeline="nightly", retry_failed=True)
    job = submit_bulk(session, dispatcher, asked).job
    ingest = session.get(Ingest, job.id)
    assert ingest is not None and ingest.retry_failed


def test_a_pipeline_name_is_bound_to_its_source(
    session: Session, dispatcher: RecordingDispatcher
) -> None:
    first = submit_bulk(session, dispatcher, request(pipeline="nightly")).job
    _close(session, first.id)
    with pytest.raises(ConflictError) as refused:
        submit_bulk(session, dispatcher, request("s3://photos/2027/", pipeline="nightly"))
    assert "use another name" in str(refused.value)
    strict = Source(PHOTOS, case_sensitive=True)  # other filters: another source
    with pytest.raises(ConflictError):
        submit_bulk(session, dispatcher, request(strict, pipeline="nightly"))
