"""Submitting, cancelling and reporting on jobs: plain functions shared by the API and CLI.

Each writing function is one unit of work (the commit rule: app/__init__.py).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.app import families, sources, video
from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.catalog.fallback import check_fallback
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError, TransientError
from kiln.app.db import queries
from kiln.app.db import webhooks as deliveries
from kiln.app.db.items import NewItem, insert_items
from kiln.app.db.models import ItemStatus, Job, JobStatus, aware, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import BULK, INTERACTIVE, Dispatcher
from kiln.app.jobs import job_counts, throughput
from kiln.app.jobs.job_lookup import find_job
from kiln.app.jobs.webhooks import job_notify
from kiln.app.observability.tracing import annotate, traced
from kiln.app.sources import parse_s3_uri
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import NewObject
from kiln.app.tenants import quotas, tenants

log = logging.getLogger(__name__)

INTERACTIVE_MAX_ITEMS = 256  # larger jobs go to the bulk queue so small ones are not starved


@dataclass(frozen=True)
class Upload:
    filename: str
    data: bytes
    content_type: str | None = None


@dataclass(frozen=True)
class InputRef:
    uri: str | None = None
    text: str | None = None
    key: str | None = None  # the item's name; defaults to the URI


@dataclass(frozen=True)
class JobRequest:
    tenant: str
    model: str
    uploads: Sequence[Upload] = ()
    inputs: Sequence[InputRef] = ()
    options: dict[str, Any] | None = None
    idempotency_key: str | None = None
    local_files: bool = False  # file:// inputs: only `kiln run` on its own machine sets this
    notify: dict[str, Any] | None = None  # its webhook {url, events}, checked (webhooks.py)
    retention_s: int | None = None  # its `expires_after` (app/jobs/retention.py)


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool
    counts: queries.Counts | None = None  # known without a query for a job just created


@traced("kiln.job.submit")
def submit_job(
    session: Session,
    store: ObjectStore,
    dispatcher: Dispatcher,
    settings: Settings,
    request: JobRequest,
    most_open: int | None = None,
) -> Submitted:
    """Store inputs, record the job and its items in one transaction, then enqueue chunks.

    `most_open`: the tenant's cap on open jobs, held inside that transaction (`quotas`).
    Whatever refuses the job once its uploads are stored, the uploads are removed again.
    """
    if request.idempotency_key:
        existing = by_idempotency_key(session, request.tenant, request.idempotency_key)
        if existing is not None:
            return Submitted(existing, created=False)
    model, options = _check_request(session, settings, request)
    job_id = str(uuid.uuid4())
    count = len(request.uploads) + len(request.inputs)
    size = settings.bulk_chunk_size if queue_for(count) == BULK else settings.chunk_size
    rows = _new_items(job_id, request, size)
    job = Job(
        id=job_id,
        tenant=request.tenant,
        model=model.ref,  # the exact version, even if a newer one is registered meanwhile
        status=JobStatus.QUEUED,
        options=options,  # the fallback, if any, pinned to its exact version too
        idempotency_key=request.idempotency_key,
        chunk_count=-(-len(rows) // size),
        queue=queue_for(len(rows)),
        notify=job_notify(session, request.tenant, request.notify),
        retention_s=request.retention_s,
    )
    try:
        _store_uploads(store, job_id, request)
        with unit_of_work(session):
            quotas.check_open_jobs(session, request.tenant, most_open)
            chunks = _insert_job(session, job, rows)
    except BaseException as error:  # rolled back: no row points at the uploads
        _delete_inputs(store, job_id, request)
        if isinstance(error, IntegrityError) and request.idempotency_key:
            # a concurrent request with the same key won the race
            existing = by_idempotency_key(session, request.tenant, request.idempotency_key)
            if existing is not None:
                return Submitted(existing, created=False)
        raise
    annotate(job_id=job_id, model=job.model, items=len(rows), chunks=job.chunk_count)
    dispatch_job(session, dispatcher, job, chunks)
    return Submitted(job, True, queries.Counts(total=len(rows), pending=len(rows)))


def _insert_job(session: Session, job: Job, items: list[NewItem]) -> dict[int, list[int]]:
    """The job, then its items (one statement) and counters; returns the items' ids by chunk."""
    session.add(job)
    session.flush()
    return insert_items(session, job.id, items)


def dispatch_job(
    session: Session, dispatcher: Dispatcher, job: Job, chunks: dict[int, list[int]]
) -> None:
    """Send one message per chunk (its items' ids), after the commit."""
    with failing_unqueued(session, job):
        for chunk, ids in sorted(chunks.items()):
            dispatcher.enqueue_chunk(job.id, chunk, ids, job.queue)
    if not chunks:  # a job with no items is complete at once
        with unit_of_work(session):
            queries.finish_job_if_done(session, job.id)


def queue_for(items: int) -> str:
    """Large jobs go to the bulk queue so small ones are not starved."""
    return INTERACTIVE if items <= INTERACTIVE_MAX_ITEMS else BULK


@contextmanager
def failing_unqueued(session: Session, job: Job) -> Iterator[None]:
    """Around the sends of a committed job: if the broker refuses, the job fails (with a
    sentence) rather than waiting forever, and the caller gets a TransientError (503)."""
    try:
        yield
    except Exception as error:
        log.exception("could not enqueue job %s", job.id)
        with unit_of_work(session):
            job.status, job.error, job.finished_at = (JobStatus.FAILED, UNQUEUED, utcnow())
            deliveries.record_end(session, job.id, JobStatus.FAILED.value)
            # no item stays pending in a closed job: each says why it did not run
            queries.end_pending(session, job.id, ItemStatus.FAILED, UNQUEUED)
        raise TransientError("The job could not be queued: the broker is unreachable.") from error


UNQUEUED = "Kiln could not reach its queue."


def by_idempotency_key(session: Session, tenant: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key))


def _check_request(
    session: Session, settings: Settings, request: JobRequest
) -> tuple[ModelInfo, dict[str, Any]]:
    """The job's model and the options to store, or an InputError with a sentence."""
    try:
        model = get_model(session, request.model, request.tenant)
    except NotFoundError as error:
        raise InputError(str(error)) from None
    count = len(request.uploads) + len(request.inputs)
    if count == 0:
        raise InputError("A job needs at least one input: upload files or list inputs.")
    if count > settings.max_files_per_job:
        raise InputError(
            f"A job takes at most {settings.max_files_per_job} inputs; this one has {count}."
        )
    for ref in request.inputs:
        if (ref.uri is None) == (ref.text is None):
            raise InputError('Each input needs exactly one of "uri" or "text".')
        if ref.text is not None and model.input != "text":
            raise InputError(f"Model {model.name!r} takes images, not text.")
        if ref.uri is not None and model.input != "image":
            raise InputError(f"Model {model.name!r} takes text, not images.")
    if request.uploads and model.input != "image":
        raise InputError(f"Model {model.name!r} takes text, not files.")
    options = check_options(session, request.tenant, model, request.options or {})
    keys = _item_keys(request)  # a bad request is a 422 before any bucket is judged
    _check_videos(settings, request, keys, options)
    _check_s3_inputs(session, request)
    return model, options


def _check_videos(
    settings: Settings, request: JobRequest, keys: list[str], options: dict[str, Any]
) -> None:
    """An uploaded video whose header already says it is over a limit is refused now, with a
    sentence naming it (a video in a bucket is judged by the worker, on its item)."""
    fps = float(options.get(video.FPS_OPTION, video.DEFAULT_FPS))
    limits = video.VideoLimits(settings.max_video_frames, settings.max_video_duration_s)
    for key, upload in zip(keys, request.uploads, strict=False):
        if video.container_of(upload.data[: video.HEAD_BYTES]) is None:
            continue
        if (header := video.read_header(upload.data)) is None:
            continue
        if why := video.refusal(header.duration_s, header.frames, fps, limits, own_fps=header.fps):
            raise InputError(f"{key}: {why}")


def _check_s3_inputs(session: Session, request: JobRequest) -> None:
    """Every URI is s3:// (or a `kiln run` file://) in a bucket the tenant may read."""
    uris = [r.uri for r in request.inputs if r.uri and not _is_local(r.uri, request)]
    for uri in uris:
        parse_s3_uri(uri)
    tenants.check_buckets(session, request.tenant, uris)


def check_options(
    session: Session, tenant: str, model: ModelInfo, options: dict[str, Any]
) -> dict[str, Any]:
    """The job's options against the model family's declared options (`kiln.app.families`)
    and its fallback against the catalog (`kiln.app.catalog.fallback`); returns them with the
    fallback pinned to its exact version. `video_fps`, how the job samples videos, is any job's."""
    rest = {k: v for k, v in options.items() if k != video.FPS_OPTION}
    families.check_options(model.kind, model.name, rest)
    checked = check_fallback(session, tenant, model, rest)
    if video.FPS_OPTION in options:
        checked = {**checked, video.FPS_OPTION: video.check_fps(options[video.FPS_OPTION])}
    return checked


def _is_local(uri: str, request: JobRequest) -> bool:
    """A file:// input of `kiln run` (the operator's own machine): no bucket to allow."""
    return request.local_files and uri.startswith("file:///")


def _item_keys(request: JobRequest) -> list[str]:
    keys = [u.filename for u in request.uploads]
    keys += [ref.key or ref.uri or f"text-{i}" for i, ref in enumerate(request.inputs)]
    seen: set[str] = set()
    for key in keys:
        if not key:
            raise InputError("Every uploaded file needs a filename.")
        if key in seen:
            raise InputError(f"Two inputs share the name {key!r}; names identify items.")
        seen.add(key)
    return keys


def _upload_key(job_id: str, index: int) -> str:
    return f"jobs/{job_id}/inputs/{index:06d}"


def _store_uploads(store: ObjectStore, job_id: str, request: JobRequest) -> None:
    """Uploaded bytes go to storage before the job exists, so any worker can fetch them."""
    store.put_new(
        [
            NewObject(_upload_key(job_id, index), upload.data, upload.content_type)
            for index, upload in enumerate(request.uploads)
        ]
    )


def _new_items(job_id: str, request: JobRequest, chunk_size: int) -> list[NewItem]:
    """The job's items, uploads first, in submission order."""
    keys = _item_keys(request)
    sources_: list[tuple[str | None, str | None]] = [
        (sources.in_store(_upload_key(job_id, i)), None) for i in range(len(request.uploads))
    ]
    sources_ += [(ref.uri, ref.text) for ref in request.inputs]
    return [
        NewItem(key, index // chunk_size, source, text)
        for index, (key, (source, text)) in enumerate(zip(keys, sources_, strict=True))
    ]


def _delete_inputs(store: ObjectStore, job_id: str, request: JobRequest) -> None:
    for index in range(len(request.uploads)):
        try:
            store.delete(_upload_key(job_id, index))
        except Exception as error:  # the refusal matters more than the cleanup
            log.warning("could not remove upload %d of refused job %s: %s", index, job_id, error)


def cancel_job(session: Session, tenant: str, job_id: str) -> Job:
    """Stop a job (by its id or a unique prefix of it): pending items are cancelled now,
    running chunks drain, results are kept."""
    with unit_of_work(session):
        job_id = find_job(session, tenant, job_id).id
        job = queries.lock_job(session, job_id, tenant)
        if job is None:
            raise NotFoundError(f"There is no job {job_id}.")
        if not queries.is_open(job):
            raise ConflictError(
                f"Job {job_id} is already {job.status}; only open jobs can be cancelled."
            )
        job.status = JobStatus.CANCELLING
        queries.cancel_items(session, job_id)
        session.flush()
        queries.finish_job_if_done(session, job_id)
    session.refresh(job)
    return job


def get_job(session: Session, tenant: str, job_id: str) -> Job:
    """The tenant's job by its id or a unique prefix of it (`job_lookup.find_job`)."""
    return find_job(session, tenant, job_id)


RATE_WINDOW_S = 60.0  # an open job's items/s: over its last minute, so the ETA is steady
ETA_AFTER_SHARE = 0.1  # a job younger than the window gives an ETA once this share is done
STALE_RENEWALS = 4  # leases unrenewed this many renewal periods (at least 10 s): their run stopped


@dataclass(frozen=True)
class LeaseTiming:
    """The workers' lease settings, which tell a run that stopped renewing from a busy one."""

    lease_s: float
    renew_s: float

    @classmethod
    def of(cls, settings: Settings) -> LeaseTiming:
        return cls(settings.lease_s, settings.lease_renew_s)

    @property
    def stale_s(self) -> float:
        """Unrenewed this long, a lease's run has stopped (never longer than the lease: an
        expired lease is stale whatever its settings)."""
        return min(self.lease_s, max(10.0, STALE_RENEWALS * self.renew_s))


@dataclass(frozen=True)
class Progress:
    job: Job
    counts: queries.Counts  # `pending` there: every item not ended, running ones included
    items_per_second: float | None
    started_at: datetime | None
    finished_at: datetime | None
    created_at: datetime
    eta_seconds: float | None = None  # unknown while a bulk job is still listing
    running: int = 0  # items a worker holds (in prep or a batch); open jobs only
    stalled_since: datetime | None = None  # items held by a worker that stopped renewing
    answered: int = 0  # of the running items, those answered and not yet written

    @property
    def waiting(self) -> int:
        """Items no worker holds yet."""
        return max(0, self.counts.pending - self.running)

    @property
    def processed(self) -> int:
        """Items ended, and items answered whose chunk has not written them yet: what a
        progress bar shows (it moves between chunk commits), never more than the total."""
        return job_counts.done(self.counts.done, self.answered, self.counts.total)


def progress(
    session: Session, job: Job, timing: LeaseTiming, counts: queries.Counts | None = None
) -> Progress:
    """Counts and timings; for an open job also what runs now (and how much of it is answered,
    not yet written), its rate and the ETA that rate gives, and whether a worker holding its
    items stopped renewing them (`stalled_since`, until another run takes them over)."""
    started, finished = aware(job.started_at), aware(job.finished_at)
    created = aware(job.created_at)
    assert created is not None
    if started is None or finished is not None or not queries.is_open(job):
        counts = counts or queries.job_counts(session, job.id, bulk=job.source is not None)
        rate = _overall_rate(counts, started, finished)
        return Progress(job, counts, rate, started, finished, created)
    # An open job's counts are read beside its activity, not before (`_consistent`); one
    # read before that would be a third read of counters a busy job writes all the time.
    now = utcnow()
    window_start = max(started, now - timedelta(seconds=RATE_WINDOW_S))
    counts, activity, answered_rows = _consistent(session, job, window_start, timing)
    rate = _live_rate(activity, window_start, now)
    answered = min(answered_rows, activity.running)
    left = counts.pending - answered
    # No ETA while listing (the total grows), stalled (some items wait on the reconciler), or
    # in a young job's first tenth (its rate still carries the model's loading).
    settled = (now - started).total_seconds() > RATE_WINDOW_S or (
        counts.done + answered >= ETA_AFTER_SHARE * counts.total
    )
    knowable = not counts.listing and activity.stalled_since is None and settled
    eta = round(left / rate, 1) if rate and knowable else None
    return Progress(
        job, counts, rate, started, None, created, eta, activity.running,
        activity.stalled_since, answered,
    )  # fmt: skip


def _consistent(
    session: Session, job: Job, window_start: datetime, timing: LeaseTiming
) -> tuple[queries.Counts, queries.Activity, int]:
    """The job's activity, and its counts with its live runs' answered rows read in one
    statement (`queries.counts_and_answered`): a chunk's write moves its rows from the one to
    the other in one transaction, and read apart a write between them left a chunk out of both
    (the bar stepped back by a chunk) or in both. One read each: a busy job's counters are
    written all the time, and read again until they agreed they cost its polls twice."""
    activity = queries.job_activity(session, job.id, window_start, timing.lease_s, timing.stale_s)
    fresh_since = utcnow() - timedelta(seconds=timing.stale_s)
    counts, answered = queries.counts_and_answered(
        session, job.id, job.source is not None, fresh_since
    )
    return counts, activity, answered


def _live_rate(activity: queries.Activity, window_start: datetime, now: datetime) -> float | None:
    """Items/s of an open job over its last RATE_WINDOW_S (or its age, when younger): the items
    written in the window, and the rows answered by runs still going, each run's spread over
    the run (`throughput`) so a chunk's write moves its rows from one to the other, not the
    rate."""
    low, high = window_start.timestamp(), now.timestamp()
    written = throughput.Span(low, high, activity.recent)
    per_second = throughput.rate([written, *activity.in_flight.spans], low, high)
    return None if per_second is None else round(per_second, 2)


def _overall_rate(
    counts: queries.Counts, started: datetime | None, finished: datetime | None
) -> float | None:
    if started is None:
        return None
    elapsed = ((finished or utcnow()) - started).total_seconds()
    return round((counts.succeeded + counts.failed) / elapsed, 2) if elapsed > 0 else None
