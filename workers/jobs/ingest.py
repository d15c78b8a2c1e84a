"""The ingest of a bulk job: list `s3://bucket/prefix` page by page into items and chunks.

One step lists up to `ingest_pages_per_step` pages (S3's paginator, `StartAfter` the last key
committed), and per page, in one transaction: the items (one INSERT), the pipeline's seen
objects, the cursor. Chunks are sent after that commit, as far as the fair share between
tenants lets them (app/jobs/fair_share.py: the rest wait unsent, for a chunk's finish, the
next step or the reconciler to send them). Then the step sends its successor —
at once, or after a pause while the job has `bulk_max_chunks` chunks outstanding
(backpressure) — so no task runs for long and a bucket is never held in memory or in Redis.

The claim, the unsent chunks, each page and the finish are each one unit of work (the commit
rule: app/__init__.py). A step holds the ingest by a claim (owner + heartbeat in Postgres). A
step that dies leaves a stale heartbeat; the reconciler sends a new step, which resumes after
the last committed key: nothing listed twice, nothing missed. A redelivered step of a live
ingest finds the claim taken and does nothing; a step that finds it taken over stops.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, KilnError
from kiln.app.db import ingest as db
from kiln.app.db import queries, webhooks
from kiln.app.db.models import Ingest, Job, JobStatus, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.jobs import fair_share
from kiln.app.jobs.ingest import Source
from kiln.app.results import results
from kiln.app.storage.s3 import translate
from kiln.workers.close.close import close_closed_job
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
    objects: list[db.Listed]  # those the filters let through
    last_key: str | None
    final: bool
    excluded: int = 0  # objects the filters left out (folder markers are not objects)


def ingest_step(
    runtime: WorkerRuntime, dispatcher: Dispatcher, job_id: str, owner: str | None = None
) -> StepReport:
    """One step of the job's ingest: a run of units of work (the commit rule:
    app/__init__.py) — the claim, the chunks left unsent, then one per page listed."""
    owner = owner or str(uuid.uuid4())
    with runtime.sessions() as session:
        with unit_of_work(session):
            claimed = db.claim(session, job_id, owner, runtime.settings.ingest_stale_s)
        if claimed is None:
            return StepReport(job_id, "busy")
        job = session.get(Job, job_id)
        assert job is not None and job.source is not None
        try:
            return _step(runtime, session, dispatcher, job, owner)
        except _TakenOver:
            return StepReport(job_id, "busy")


def _step(
    runtime: WorkerRuntime, session: Session, dispatcher: Dispatcher, job: Job, owner: str
) -> StepReport:
    if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):  # cancelling or closed
        return _finish(runtime, session, job, owner, deleted=False)
    _send_chunks(runtime, session, dispatcher, job, owner)
    try:
        return _Step(runtime, session, dispatcher, job, owner).run()
    except InputError as error:  # a missing bucket, a denied listing: the job cannot run
        return _fail(session, job, owner, str(error))


class _Cancelled(Exception):
    """The job is being cancelled: list no more."""


class _TakenOver(Exception):
    """Another step holds the ingest now: this one stops, its unit rolled back."""


def _held(session: Session, job_id: str, owner: str) -> Ingest:
    """The ingest row, locked for the unit, while `owner` still holds it."""
    ingest = db.still_owner(session, job_id, owner)
    if ingest is None:
        raise _TakenOver
    return ingest


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
        self.pages = self.listed = self.queued = 0

    def run(self) -> StepReport:
        try:
            return self._list()
        except _Cancelled:
            return _finish(self.runtime, self.session, self.job, self.owner, deleted=False)

    def _list(self) -> StepReport:
        ingest = self.session.get(Ingest, self.job.id)
        assert ingest is not None
        try:
            for page in self._pages(ingest.cursor):
                self.queued += self._record(page)
                self.pages, self.listed = self.pages + 1, self.listed + len(page.objects)
                _send_chunks(self.runtime, self.session, self.dispatcher, self.job, self.owner)
                outcome = self._stop_after(page)
                if outcome is not None:
                    return self._report(outcome)
            # no page at all: listing ended exactly at the cursor
            return self._report(self._finish().outcome)
        except _TakenOver:
            return self._report("busy")

    def _stop_after(self, page: Page) -> str | None:
        """How this step ends after `page` (its outcome), or None to list the next page."""
        if page.final:
            return self._finish().outcome
        if self.pages >= self.settings.ingest_pages_per_step:
            self.dispatcher.enqueue_ingest(self.job.id, self.owner)
            return "continue"
        if db.outstanding_chunks(self.session, self.job.id) >= self.settings.bulk_max_chunks:
            self.dispatcher.enqueue_ingest(self.job.id, self.owner, BACKPRESSURE_PAUSE_S)
            return "throttled"
        return None

    def _report(self, outcome: str) -> StepReport:
        return StepReport(self.job.id, outcome, self.pages, self.listed, self.queued)

    def _finish(self) -> StepReport:
        return _finish(self.runtime, self.session, self.job, self.owner, deleted=True)

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
            keys = [o for o in contents if not o["Key"].endswith("/")]
            objects = [
                db.Listed(o["Key"], str(o.get("ETag", "")).strip('"'))
                for o in keys
                if self.source.matches(o["Key"])
            ]
            last = contents[-1]["Key"] if contents else None
            final = not raw.get("IsTruncated")
            yield Page(objects, last, final, excluded=len(keys) - len(objects))

    def _record(self, page: Page) -> int:
        """One unit of work for a page: items, seen objects, cursor. Returns the chunks added."""
        session, job = self.session, self.job
        with unit_of_work(session):
            locked = queries.lock_job(session, job.id)  # job row first, as every writer does
            ingest = _held(session, job.id, self.owner)
            if locked is None:
                raise _TakenOver
            if locked.status == JobStatus.CANCELLING:
                raise _Cancelled
            seen = db.Sorted(page.objects)
            if job.pipeline_id is not None:
                seen = db.changed_objects(
                    session, job.pipeline_id, job.id, job.model, page.objects,
                    ingest.retry_failed,
                )  # fmt: skip
            chunks = db.insert_items(
                session, job.id, self.source.bucket, seen.fresh, locked.chunk_count,
                self.settings.bulk_chunk_size,
            )  # fmt: skip
            locked.chunk_count += chunks
            ingest.cursor = page.last_key or ingest.cursor
            ingest.listed += len(page.objects)
            ingest.excluded += page.excluded
            ingest.skipped += seen.unchanged
            ingest.known_failed += seen.known_failed
            ingest.pages += 1
            ingest.heartbeat_at = utcnow()
        return chunks


def _send_chunks(
    runtime: WorkerRuntime, session: Session, dispatcher: Dispatcher, job: Job, owner: str
) -> None:
    """Send chunks committed and not sent yet — this job's and every other open bulk job's —
    up to each job's fair share of the window (app/jobs/fair_share.top_up); the rest wait for
    a chunk's finish, the next step or the reconciler. Their items were committed by an
    earlier unit (a page's); a crash before a send is recorded only sends it again, which is
    harmless. A step that lost its claim stops here."""
    with unit_of_work(session):
        _held(session, job.id, owner)
    fair_share.top_up(runtime.sessions, dispatcher, runtime.settings)


def _finish(
    runtime: WorkerRuntime, session: Session, job: Job, owner: str, deleted: bool
) -> StepReport:
    """Listing is over: report deleted objects, mark the ingest done, close the job if no item
    is open (a rerun with nothing changed closes here). One unit of work, then the manifest."""
    with unit_of_work(session):
        # The job lock orders this against a chunk finishing now: one of the two sees the other.
        queries.lock_job(session, job.id)
        ingest = _held(session, job.id, owner)
        if deleted and job.pipeline_id is not None:
            gone = db.forget_unseen(session, job.pipeline_id, job.id)
            ingest.deleted = len(gone)
            if gone:
                results.write_keys(runtime.place(job.id, job.output), "deleted.parquet", gone)
        ingest.done, ingest.heartbeat_at = True, utcnow()
        session.flush()
        closed = queries.finish_job_if_done(session, job.id)
    if closed is not None:
        close_closed_job(runtime, session, job)
    log.info(
        "ingest %s: listed %d (%d left out by the filters), skipped %d, %d known failures "
        "kept, deleted %d, %d chunks",
        job.id, ingest.listed, ingest.excluded, ingest.skipped, ingest.known_failed,
        ingest.deleted, job.chunk_count,
    )  # fmt: skip
    return StepReport(job.id, "done")


def _fail(session: Session, job: Job, owner: str, reason: str) -> StepReport:
    """The source cannot be listed: the job fails with that sentence; nothing pending runs.
    One unit of work."""
    with unit_of_work(session):
        locked = queries.lock_job(session, job.id)
        ingest = _held(session, job.id, owner)
        if locked is None:
            raise _TakenOver
        ingest.done = True
        queries.cancel_items(session, job.id)
        locked.status, locked.error, locked.finished_at = JobStatus.FAILED, reason, utcnow()
        webhooks.record_end(session, job.id, JobStatus.FAILED.value)
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
