"""Replaying what failed: a new job over a closed job's failed items (and its cancelled ones, if
asked), same model version and options unless the request names others, linked both ways
(`Job.retry_of`; the original's answer lists its retries).

The items are copied in the database (one INSERT … SELECT, chunked as a submission chunks:
no per-item Python loop, whatever the job's size); a bulk job's items keep their `s3://`
sources and ETags, so the retry runs exactly those objects without listing the bucket again.
A pipeline's run replays as a run of the same pipeline, so what now succeeds is remembered
(the next night skips it). One unit of work, with the open-jobs quota and the per-tenant
idempotency key of a submission (the commit rule: app/__init__.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db import counters, queries
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import BULK, Dispatcher
from kiln.app.jobs import jobs, retention
from kiln.app.jobs.job_lookup import find_job
from kiln.app.tenants import quotas


@dataclass(frozen=True)
class RetryRequest:
    tenant: str
    job_id: str  # the job to replay: its id or a unique prefix of it
    include_cancelled: bool = False
    model: str | None = None  # default: the job's exact model ref
    options: dict[str, Any] | None = None  # default: the job's options
    idempotency_key: str | None = None
    notify: dict[str, Any] | None = None  # default: the job's webhook


def retries_of(session: Session, job_id: str) -> list[str]:
    """The jobs that replay `job_id`'s failures, oldest first (`ix_jobs_retry_of`)."""
    query = select(Job.id).where(Job.retry_of == job_id).order_by(Job.created_at, Job.id)
    return list(session.scalars(query))


def retry_job(
    session: Session,
    dispatcher: Dispatcher,
    settings: Settings,
    request: RetryRequest,
    most_open: int | None = None,
) -> jobs.Submitted:
    """Start the new job and send its chunks; an earlier retry with the same key is returned
    as it is (`created` False). NotFoundError: no such job of the tenant; ConflictError: the
    job is open, or retention deleted its items; InputError: nothing to replay, or a model or
    options a submission would refuse."""
    if request.idempotency_key:
        existing = jobs.by_idempotency_key(session, request.tenant, request.idempotency_key)
        if existing is not None:
            return jobs.Submitted(existing, created=False)
    original = find_job(session, request.tenant, request.job_id)
    _check_replayable(original)
    statuses = _statuses(request.include_cancelled)
    wanted = _replayable_count(session, original, statuses)
    if wanted == 0:
        more = " or cancelled" if request.include_cancelled else ""
        hint = "" if request.include_cancelled else " (add include_cancelled for cancelled ones)"
        raise ConflictError(f"Job {original.id} has no failed{more} items to retry{hint}.")
    model, options = _model_and_options(session, request, original)
    queue = BULK if original.queue == BULK else jobs.queue_for(wanted)
    size = settings.bulk_chunk_size if queue == BULK else settings.chunk_size
    job = Job(
        id=str(uuid.uuid4()),
        tenant=request.tenant,
        model=model.ref,
        status=JobStatus.QUEUED,
        options=options,
        idempotency_key=request.idempotency_key,
        queue=queue,
        output=original.output,
        pipeline_id=original.pipeline_id,
        retry_of=original.id,
        retention_s=original.retention_s,
        notify=request.notify if request.notify is not None else original.notify,
    )
    try:
        with unit_of_work(session):
            quotas.check_open_jobs(session, request.tenant, most_open)
            session.add(job)
            session.flush()
            chunks = copy_items(session, original.id, job.id, statuses, size)
            job.chunk_count = len(chunks)
    except IntegrityError:
        if request.idempotency_key:  # a concurrent request with the same key won the race
            existing = jobs.by_idempotency_key(session, request.tenant, request.idempotency_key)
            if existing is not None:
                return jobs.Submitted(existing, created=False)
        raise
    jobs.dispatch_job(session, dispatcher, job, chunks)
    total = sum(len(ids) for ids in chunks.values())
    return jobs.Submitted(job, True, queries.Counts(total=total, pending=total))


def _check_replayable(job: Job) -> None:
    if queries.is_open(job):
        raise ConflictError(
            f"Job {job.id} is still {job.status}; retry its failed items once it has ended "
            "(or cancel it first)."
        )
    retention.check_not_expired(job)


def _statuses(include_cancelled: bool) -> tuple[str, ...]:
    failed = (ItemStatus.FAILED.value,)
    return (*failed, ItemStatus.CANCELLED.value) if include_cancelled else failed


def _replayable_count(session: Session, job: Job, statuses: tuple[str, ...]) -> int:
    """From the job's counters (a few rows, whatever its size)."""
    tally = counters.read(session, job.id)
    return tally.failed + (tally.cancelled if ItemStatus.CANCELLED.value in statuses else 0)


def _model_and_options(
    session: Session, request: RetryRequest, original: Job
) -> tuple[ModelInfo, dict[str, Any]]:
    """The job's exact model and options, or those the request names, checked as a
    submission checks them (a model that takes other inputs is refused)."""
    ref = request.model or original.model
    try:
        model = get_model(session, ref, request.tenant)
    except NotFoundError as error:
        raise InputError(str(error)) from None
    if request.model is not None and request.model != original.model:
        before = _input_of(session, original)
        if before is not None and before != model.input:
            raise InputError(
                f"Job {original.id}'s items are {before}s; model {model.name!r} takes "
                f"{model.input}s."
            )
    options = original.options if request.options is None else request.options
    return model, jobs.check_options(session, request.tenant, model, dict(options or {}))


def _input_of(session: Session, job: Job) -> str | None:
    try:
        return get_model(session, job.model, job.tenant).input
    except NotFoundError:
        return None  # its model is gone: judge by the new one alone


# The replayed items, numbered in the original's order and chunked as a submission chunks them
# (`chunk = position // size`), copied in one statement on both dialects.
_COPY = text(
    """
    INSERT INTO items (job_id, key, source, text, etag, chunk, frame_index, frame_time_s,
                       status, attempts, queued_at)
    SELECT :new_job, key, source, text, etag,
           CAST((ROW_NUMBER() OVER (ORDER BY id) - 1) / :size AS INTEGER),
           frame_index, frame_time_s, 'pending', 0, :now
    FROM items
    WHERE job_id = :old_job AND status IN :statuses
    ORDER BY id
    RETURNING id, chunk
    """
).bindparams(
    bindparam("statuses", expanding=True),
    bindparam("now", type_=Item.__table__.c.queued_at.type),
)


def copy_items(
    session: Session, old_job: str, new_job: str, statuses: tuple[str, ...], size: int
) -> dict[int, list[int]]:
    """Copy the old job's items of `statuses` into the new job as pending, count them, and
    return their ids by chunk (what the chunk messages carry)."""
    params = {"new_job": new_job, "old_job": old_job, "statuses": list(statuses), "size": size}
    rows = session.execute(_COPY, {**params, "now": utcnow()}).all()
    chunks: dict[int, list[int]] = {}
    for item_id, chunk in sorted((int(a), int(b)) for a, b in rows):
        chunks.setdefault(chunk, []).append(item_id)
    if rows:
        counters.add(session, new_job, counters.slot_of(0), counters.Tally(total=len(rows)))
    return chunks
