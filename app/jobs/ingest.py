"""Bulk jobs: a whole `s3://bucket/prefix`, listed by an ingest task, optionally incremental.

Submitting records the job and its ingest state and sends one `ingest` message; the listing,
the items and the chunks come from the worker side (`workers.jobs.ingest`), page by page.
Submitting is one unit of work (the commit rule: app/__init__.py); `stage_bulk` lends its
writes to another unit (a schedule's run).
"""

from __future__ import annotations

import fnmatch
import re
import uuid
from dataclasses import KW_ONLY, dataclass, field
from functools import cached_property
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db.models import OPEN_JOB_STATUSES, Ingest, Job, JobStatus, Pipeline
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import BULK, Dispatcher
from kiln.app.jobs import outputs
from kiln.app.jobs.jobs import Submitted, by_idempotency_key, check_options, failing_unqueued
from kiln.app.jobs.webhooks import job_notify
from kiln.app.observability.tracing import traced
from kiln.app.sources import parse_s3_uri
from kiln.app.storage.base import S3Factory
from kiln.app.tenants import quotas, tenants

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
MAX_PATTERNS = 50


@dataclass(frozen=True)
class Source:
    """`s3://bucket/prefix` and glob filters on each key's path below the prefix. The globs
    match in any case unless `case_sensitive` (`*.jpg` takes a camera's `IMG_0001.JPG`)."""

    uri: str
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    case_sensitive: bool = False

    @property
    def bucket(self) -> str:
        return parse_s3_uri(self.uri)[0]

    @property
    def prefix(self) -> str:
        return parse_s3_uri(self.uri)[1]

    @cached_property
    def _include(self) -> list[re.Pattern[str]]:
        return self._compiled(self.include)

    @cached_property
    def _exclude(self) -> list[re.Pattern[str]]:
        return self._compiled(self.exclude)

    def _compiled(self, globs: tuple[str, ...]) -> list[re.Pattern[str]]:
        flags = 0 if self.case_sensitive else re.IGNORECASE
        return [re.compile(fnmatch.translate(glob), flags) for glob in globs]

    def matches(self, key: str) -> bool:
        """Included (by any `include` glob, or all when none) and not excluded."""
        name = key[len(self.prefix) :].lstrip("/")
        if self._include and not any(glob.match(name) for glob in self._include):
            return False
        return not any(glob.match(name) for glob in self._exclude)

    def to_json(self) -> dict[str, Any]:
        return {
            "s3": self.uri,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "case_sensitive": self.case_sensitive,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Source:
        """A source as `to_json` wrote it; one recorded before `case_sensitive` existed matches
        in any case, as every source does now unless asked."""
        return cls(
            data["s3"],
            tuple(data.get("include", ())),
            tuple(data.get("exclude", ())),
            bool(data.get("case_sensitive", False)),
        )

    def check(self) -> None:
        parse_s3_uri(self.uri)  # raises InputError with a sentence
        if len(self.include) + len(self.exclude) > MAX_PATTERNS:
            raise InputError(f"A source takes at most {MAX_PATTERNS} include/exclude patterns.")
        if any(not p for p in (*self.include, *self.exclude)):
            raise InputError("Include and exclude patterns must not be empty.")


@dataclass(frozen=True)
class BulkRequest:
    """A bulk job as asked for: whose, which model, what to list; the rest by name."""

    tenant: str
    model: str
    source: Source
    _: KW_ONLY
    pipeline: str | None = None
    output: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    idempotency_key: str | None = None
    retry_failed: bool = False  # a pipeline's run: retry its known failures too
    schedule: str | None = None  # the schedule whose run this is
    notify: dict[str, Any] | None = None  # its webhook {url, events}, checked (webhooks.py)
    retention_s: int | None = None  # its `expires_after` (app/jobs/retention.py)


@traced("kiln.bulk.submit")
def submit_bulk(
    session: Session,
    dispatcher: Dispatcher,
    request: BulkRequest,
    most_open: int | None = None,
    *,
    s3: S3Factory | None = None,
) -> Submitted:
    """Record the job and its ingest state, then send the first ingest message. `most_open`:
    the tenant's cap on open jobs (`quotas.check_open_jobs`). `s3`: Kiln's S3 clients, to
    probe the job's `output` first (the API's door; a caller without one skips the probe)."""
    if request.idempotency_key:
        existing = by_idempotency_key(session, request.tenant, request.idempotency_key)
        if existing is not None:
            return Submitted(existing, created=False)
    if s3 is not None and request.output:  # before the unit: no lock held while S3 answers
        outputs.check_output(session, request.tenant, request.output, s3)
    with unit_of_work(session):
        quotas.check_open_jobs(session, request.tenant, most_open)
        job = stage_bulk(session, request)
    start_ingest(session, dispatcher, job)
    return Submitted(job, True)


def stage_bulk(session: Session, request: BulkRequest) -> Job:
    """Add the job and its ingest state to the caller's unit of work, uncommitted. Every check
    runs before a row is added, so a refusal leaves the unit as it was."""
    model, options = _check(session, request)
    pipeline = _pipeline(session, request) if request.pipeline else None
    job = Job(
        id=str(uuid.uuid4()),
        tenant=request.tenant,
        model=model.ref,
        status=JobStatus.QUEUED,
        options=options,  # the fallback, if any, pinned to its exact version too
        idempotency_key=request.idempotency_key,
        chunk_count=0,
        queue=BULK,
        source=request.source.to_json(),
        output=request.output,
        pipeline_id=pipeline.id if pipeline else None,
        schedule=request.schedule,
        notify=job_notify(session, request.tenant, request.notify),
        retention_s=request.retention_s,
    )
    session.add(job)
    session.flush()
    session.add(Ingest(job_id=job.id, retry_failed=request.retry_failed))
    return job


def start_ingest(session: Session, dispatcher: Dispatcher, job: Job) -> None:
    """Send the job's first ingest message, once its rows are committed; a refused send fails
    the job."""
    with failing_unqueued(session, job):
        dispatcher.enqueue_ingest(job.id)


def check_bulk(session: Session, request: BulkRequest) -> tuple[ModelInfo, dict[str, Any]]:
    """Every check a submission makes before a row is added, with its sentences; nothing
    written (an estimate asks the same of its request: `kiln.app.jobs.estimate`)."""
    return _check(session, request)


def _check(session: Session, request: BulkRequest) -> tuple[ModelInfo, dict[str, Any]]:
    try:
        model = get_model(session, request.model, request.tenant)
    except NotFoundError as error:
        raise InputError(str(error)) from None
    if model.input != "image":
        raise InputError(f"Model {model.name!r} takes text; a bucket source holds images.")
    request.source.check()
    if request.output:
        outputs.output_prefix(request.output)
    options = check_options(session, request.tenant, model, request.options)
    check_places(session, request.tenant, request.source, request.output)
    return model, options


def check_places(session: Session, tenant: str, source: Source, output: str | None) -> None:
    """The tenant may read the source's bucket and write results to the output's."""
    tenants.check_buckets(session, tenant, [source.uri])
    if output:
        tenants.check_buckets(session, tenant, [output], verb="write to")


def _pipeline(session: Session, request: BulkRequest) -> Pipeline:
    """The named pipeline (created on its first run); refuses a second concurrent run."""
    assert request.pipeline
    pipeline = session.scalar(
        select(Pipeline)
        .where(Pipeline.tenant == request.tenant, Pipeline.name == request.pipeline)
        .with_for_update()
    )
    source = request.source.to_json()
    if pipeline is None:
        pipeline = Pipeline(
            tenant=request.tenant,
            name=request.pipeline,
            source=source,
            model=request.model,
            output=request.output,
        )
        session.add(pipeline)
        session.flush()
        return pipeline
    # Compared as sources: one recorded before a field existed reads as its default.
    if Source.from_json(pipeline.source) != request.source or pipeline.model != request.model:
        raise ConflictError(
            f"Pipeline {request.pipeline!r} reads {pipeline.source['s3']} with model "
            f"{pipeline.model!r}; use another name for another source or model."
        )
    running = running_job(session, pipeline.id)
    if running is not None:
        raise ConflictError(
            f"Pipeline {request.pipeline!r} is still running job {running}; "
            "a new run starts once it has finished."
        )
    return pipeline


def running_job(session: Session, pipeline_id: int) -> str | None:
    """An open job of this pipeline, if any."""
    return session.scalar(
        select(Job.id)
        .where(Job.pipeline_id == pipeline_id, Job.status.in_(OPEN_JOB_STATUSES))
        .limit(1)
    )
