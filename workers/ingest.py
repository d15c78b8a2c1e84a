"""The ingest of a bulk job: list `s3://bucket/prefix` page by page into items and chunks.

One step lists up to `ingest_pages_per_step` pages (S3's paginator, `StartAfter` the last key
committed), and per page, in one transaction: the items (one INSERT), the pipeline's seen
objects, the cursor. Chunks are sent after that commit. Then the step sends its successor —
at once, or after a pause while the job has `bulk_max_chunks` chunks outstanding
(backpressure) — so no task runs for long and a bucket is never held in memory or in Redis.

A step holds the ingest by a claim (owner + heartbeat in Postgres). A step that dies leaves a
stale heartbeat; the reconciler sends a new step, which resumes after the last committed key:
nothing listed twice, nothing missed. A redelivered step of a live ingest finds the claim
taken and does nothing.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy.orm import Session

from kiln.app import results
from kiln.app.core.errors import InputError, KilnError
from kiln.app.db import ingest as db
from kiln.app.db import queries
from kiln.app.db.models import Ingest, Job, JobStatus, utcnow
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.ingest import Source
from kiln.app.storage.s3 import translate
from kiln.workers.chunk.finish import ensure_manifest
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

BACKPRESSURE_PAUSE_S = 2.0


@dataclass(frozen=True)
class StepReport:
    job_id: str
    outcome: str  # "busy" (another step holds it), "done", "continue", "throttled", "failed"
    pages: int = 0
    listed: int = 0
    queued: int = 0


@dataclass(frozen=True)
class Page:
    objects: list[db.Listed]
    last_key: str | None
    final: bool


def ingest_step(
    runtime: WorkerRuntime, dispatcher: Dispatcher, job_id: str, owner: str | None = None
) -> StepReport:
    owner = owner or str(uuid.uuid4())
    settings = runtime.settings
    with runtime.sessions() as session:
        claimed = db.claim(session, job_id, owner, settings.ingest_stale_s)
        session.commit()
        if claimed is None:
            return StepReport(job_id, "busy")
        job = session.get(Job, job_id)
        assert job is not None and job.source is not None
        if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):  # cancelling or closed
            return _finish(runtime, session, job, owner, deleted=False)
        _send_chunks(session, dispatcher, job, owner)
        step = _Step(runtime, session, dispatcher, job, owner)
        try:
            return step.run()
        except InputError as error:  # a missing bucket, a denied listing: the job cannot run
            session.rollback()
            return _fail(runtime, session, job, owner, str(error))


class _Cancelled(Exception):
    """The job is being cancelled: list no more."""


class _Step:
    def __init__(
        self,
        runtime: WorkerRuntime,
        session: Session,
        dispatcher: Dispatcher,
        job: Job,
        owner: str,
    ) -> None:
        self.runtime, self.session, self.dispatcher = runtime, session, dispatcher
        self.job, self.owner = job, owner
        assert job.source is not None
        self.source = Source.from_json(job.source)
        self.settings = runtime.settings

    def run(self) -> StepReport:
        pages = listed = queued = 0
        ingest = self.session.get(Ingest, self.job.id)
        assert ingest is not None
        for page in self._pages(ingest.cursor):
            try:
                added = self._record(page)
            except _Cancelled:
                return _finish(self.runtime, self.session, self.job, self.owner, deleted=False)
            if added is None:
                return StepReport(self.job.id, "busy", pages, listed, queued)  # taken over
            pages, listed, queued = pages + 1, listed + len(page.objects), queued + added
            _send_chunks(self.session, self.dispatcher, self.job, self.owner)
            if page.final:
                report = _finish(self.runtime, self.session, self.job, self.owner, deleted=True)
                return StepReport(self.job.id, report.outcome, pages, listed, queued)
            if pages >= self.settings.ingest_pages_per_step:
                break
            if db.outstanding_chunks(self.session, self.job.id) >= self.settings.bulk_max_chunks:
                self.dispatcher.enqueue_ingest(self.job.id, self.owner, BACKPRESSURE_PAUSE_S)
                return StepReport(self.job.id, "throttled", pages, listed, queued)
        else:  # no page at all: listing ended exactly at the cursor
            report = _finish(self.runtime, self.session, self.job, self.owner, deleted=True)
            return StepReport(self.job.id, report.outcome, pages, listed, queued)
        self.dispatcher.enqueue_ingest(self.job.id, self.owner)
        return StepReport(self.job.id, "continue", pages, listed, queued)

    def _pages(self, cursor: str | None) -> Iterator[Page]:
        """Pages after `cursor`, filtered; a page whose listing raised becomes the error."""
        client = self.runtime.fetcher.s3_client()
        params: dict[str, Any] = {"Bucket": self.source.bucket, "Prefix": self.source.prefix}
        if cursor:
            params["StartAfter"] = cursor
        pages = client.get_paginator("list_objects_v2").paginate(
            **params, PaginationConfig={"PageSize": self.settings.ingest_page_size}
        )
        iterator = iter(pages)
        while True:
            try:
                raw = next(iterator)
            except StopIteration:
                return
            except (ClientError, BotoCoreError) as error:
                raise _listing_error(error, self.source.uri) from error
            contents = raw.get("Contents", [])
            objects = [
                db.Listed(o["Key"], str(o.get("ETag", "")).strip('"'))
                for o in contents
                if not o["Key"].endswith("/") and self.source.matches(o["Key"])
            ]
            last = contents[-1]["Key"] if contents else None
            yield Page(objects, last, final=not raw.get("IsTruncated"))

    def _record(self, page: Page) -> int | None:
        """One transaction for a page: items, seen objects, cursor. Chunks added, or None
        if another step has taken the ingest over."""
        session, job = self.session, self.job
        locked = queries.lock_job(session, job.id)  # job row first, as every writer does
        ingest = db.still_owner(session, job.id, self.owner)
        if ingest is None or locked is None:
            session.rollback()
            return None
        if locked.status == JobStatus.CANCELLING:
            session.rollback()
            raise _Cancelled
        fresh = page.objects
        if job.pipeline_id is not None:
            fresh = db.changed_objects(session, job.pipeline_id, job.id, job.model, page.objects)
        chunks = db.insert_items(
            session, job.id, self.source.bucket, fresh, locked.chunk_count, self.settings.chunk_size
        )
        locked.chunk_count += chunks
        ingest.cursor = page.last_key or ingest.cursor
        ingest.listed += len(page.objects)
        ingest.skipped += len(page.objects) - len(fresh)
        ingest.pages += 1
        ingest.heartbeat_at = utcnow()
        session.commit()
        return chunks


def _send_chunks(session: Session, dispatcher: Dispatcher, job: Job, owner: str) -> None:
    """Send every chunk not sent yet (after a crash, those committed but never sent)."""
    ingest = db.still_owner(session, job.id, owner)
    if ingest is None:
        session.rollback()
        return
    for chunk, ids in sorted(db.unsent_chunks(session, job.id, ingest.chunks_sent).items()):
        dispatcher.enqueue_chunk(job.id, chunk, ids, job.queue)
    ingest.chunks_sent = job.chunk_count
    session.commit()


def _finish(
    runtime: WorkerRuntime, session: Session, job: Job, owner: str, deleted: bool
) -> StepReport:
    """Listing is over: report deleted objects, mark the ingest done, close the job if no item
    is open (a rerun with nothing changed closes here)."""
    # The job lock orders this against a chunk finishing now: one of the two sees the other.
    queries.lock_job(session, job.id)
    ingest = db.still_owner(session, job.id, owner)
    if ingest is None:
        session.rollback()
        return StepReport(job.id, "busy")
    if deleted and job.pipeline_id is not None:
        gone = db.forget_unseen(session, job.pipeline_id, job.id)
        ingest.deleted = len(gone)
        if gone:
            results.write_keys(runtime.place(job.id, job.output), "deleted.parquet", gone)
    ingest.done, ingest.heartbeat_at = True, utcnow()
    session.flush()
    closed = queries.finish_job_if_done(session, job.id)
    session.commit()
    if closed is not None:
        model = runtime.model_info(session, job.model, job.tenant)
        ensure_manifest(runtime, session, job.id, model, True, None)
    log.info(
        "ingest %s: listed %d, skipped %d, deleted %d, %d chunks",
        job.id, ingest.listed, ingest.skipped, ingest.deleted, job.chunk_count,
    )  # fmt: skip
    return StepReport(job.id, "done")


def _fail(
    runtime: WorkerRuntime, session: Session, job: Job, owner: str, reason: str
) -> StepReport:
    """The source cannot be listed: the job fails with that sentence; nothing pending runs."""
    locked = queries.lock_job(session, job.id)
    ingest = db.still_owner(session, job.id, owner)
    if ingest is None or locked is None:
        session.rollback()
        return StepReport(job.id, "busy")
    ingest.done = True
    queries.cancel_items(session, job.id)
    locked.status, locked.error, locked.finished_at = JobStatus.FAILED, reason, utcnow()
    session.commit()
    log.warning("ingest %s failed: %s", job.id, reason)
    return StepReport(job.id, "failed")


def _listing_error(error: Exception, uri: str) -> KilnError:
    """NoSuchBucket / AccessDenied are the job's fault (InputError); the rest are transient."""
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            bucket = uri.removeprefix("s3://").split("/", 1)[0]
            return InputError(f"The bucket {bucket!r} does not exist.")
        if code in {"AccessDenied", "403", "AllAccessDisabled"}:
            return InputError(f"Kiln may not list {uri} (access denied).")
    translated = translate(error, uri)
    assert isinstance(translated, KilnError)
    return translated
