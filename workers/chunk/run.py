"""Process one chunk of a job: lease → fetch + decode → batch → (fallback) → write results.

A plain function of a `WorkerRuntime`: the Celery task is a thin adapter over it, and tests
call it without a broker. Every write is idempotent, so a redelivered chunk is harmless. A job
with a fallback model has the inputs its model failed or refused run again through the
fallback, in the same run, before anything is written.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from kiln.app.catalog import ModelInfo
from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import KilnError, TransientError
from kiln.app.db import content_cache as cache_rows
from kiln.app.db import leases, queries
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import OPEN_JOB_STATUSES, ItemStatus, JobStatus
from kiln.app.db.session import unit_of_work
from kiln.app.families.fallback import FAILED, REFUSED, Trigger
from kiln.app.observability.tracing import annotate
from kiln.app.results import ResultRow
from kiln.workers.batching import Announcement
from kiln.workers.chunk import content_cache
from kiln.workers.chunk.fallback import Fallback, job_fallback
from kiln.workers.chunk.finish import Lease, finish_chunk
from kiln.workers.chunk.lease import LeaseKeeper
from kiln.workers.chunk.stats import STAGES
from kiln.workers.models.base import Prepared, Refusal
from kiln.workers.runtime import ModelRunner, WorkerRuntime

log = logging.getLogger(__name__)

FETCH_GROUP = 8  # inputs held in memory at once per chunk, and looked up in the cache together


@dataclass
class ChunkReport:
    job_id: str
    chunk: int
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    cached: int = 0  # answered from the content cache
    fell_back: int = 0  # taken by the job's fallback model (answered or failed again)
    # fetch (inputs + cache lookups), decode (prepare), infer (engine + finish), write
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    job_status: str | None = None


@dataclass
class _Work:
    item: LeasedItem
    started: float
    data: bytes | str | None = None
    digest: str | None = None
    cached: bool = False
    prepared: Prepared | None = None
    future: Future[Any] | None = None
    outputs: dict[str, Any] | None = None
    error: str | None = None
    cancelled: bool = False  # the job was cancelled before this input was started
    # Why the model gave no answer, when a fallback may take the input: FAILED or REFUSED
    # (None for inputs that could not be read, which no other model could read either).
    failure: Trigger | None = None
    answered_by: ModelInfo | None = None  # the model whose outputs these are
    fallback_reason: str | None = None  # the job's model's error, when its fallback took it
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, for `stages_ms`
    submitted: float = 0.0  # when its row went to the Batcher
    answered: float = 0.0  # when the engine's answer came back (the future's callback)

    @property
    def waiting(self) -> bool:
        """Fetched, not failed, not answered from the cache: it needs the engine."""
        return self.error is None and self.outputs is None and not self.cancelled


def process_chunk(
    runtime: WorkerRuntime,
    job_id: str,
    chunk: int,
    item_ids: list[int],
    urgent: bool = False,
    owner: str | None = None,
) -> ChunkReport:
    """`urgent`: an interactive chunk, whose rows go ahead of bulk rows in the Batcher.
    `owner`: this run's lease token (new per run, so a redelivered copy of a message that is
    still running elsewhere finds the items held and drops out)."""
    report = ChunkReport(job_id, chunk)
    owner = owner or str(uuid.uuid4())
    lease = lease_chunk(runtime, job_id, chunk, item_ids, owner)
    where = {"job_id": job_id, "chunk": chunk, "items": len(item_ids)}  # for log lines
    if lease is None:
        log.warning("chunk %s/%d: job no longer exists; dropping", job_id, chunk, extra=where)
        return report
    annotate(model=lease.model.ref, leased=len(lease.items))
    if lease.held_elsewhere:
        log.info(
            "chunk %s/%d: another run holds it; dropping this copy", job_id, chunk, extra=where
        )
        return report
    settings = runtime.settings
    keeper = LeaseKeeper(
        runtime.sessions, job_id, owner, settings.lease_s, settings.lease_renew_s,
        max_s=settings.run_max_s, health=runtime.health,
    )  # fmt: skip
    try:
        with keeper:
            work = _answer(runtime, lease, report, urgent, keeper)
            if keeper.lost.is_set():
                log.warning(
                    "chunk %s/%d: lease lost; another run owns the results", job_id, chunk,
                    extra=where,
                )  # fmt: skip
                return report
            timer = time.monotonic()
            fresh = _fresh(runtime, lease, work) if settings.content_cache else {}
            rows = _result_rows(work, stages=urgent)
            report.job_status = finish_chunk(runtime, lease, rows, fresh)
            report.seconds["write"] = time.monotonic() - timer
            _tally(runtime, lease, work, report)
    except BaseException:
        _release(runtime, job_id, owner)  # so the task's retry can take the items at once
        raise
    return report


def _fresh(
    runtime: WorkerRuntime, lease: Lease, work: list[_Work]
) -> dict[str, dict[str, content_cache.Entry]]:
    """Results computed by this run, for the content cache, each under the scope of the model
    that answered it: the job's model's entries never hold its fallback's answers."""
    fresh: dict[str, dict[str, content_cache.Entry]] = {}
    for w in work:
        if w.digest and w.answered_by is not None and w.outputs is not None and not w.cached:
            scope = content_cache.scope_key(runtime.settings, lease.tenant, w.answered_by)
            fresh.setdefault(scope, {})[w.digest] = content_cache.encode(w.outputs)
    return fresh


def _release(runtime: WorkerRuntime, job_id: str, owner: str) -> None:
    try:
        with runtime.sessions() as session, unit_of_work(session):
            leases.release(session, job_id, owner)
    except Exception as error:  # the database is away: the lease simply runs out
        log.warning(
            "could not release lease %s of job %s: %s", owner, job_id, error,
            extra={"job_id": job_id},
        )  # fmt: skip


def lease_chunk(
    runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int], owner: str
) -> Lease | None:
    """Take the chunk's open items and read the job (no lock on its row), then mark the job
    running if it was queued."""
    settings = runtime.settings
    with runtime.sessions() as session:
        with unit_of_work(session):
            leased = leases.take(session, job_id, item_ids, owner, settings.lease_s)
            job = leases.job_facts(session, job_id)
            if job is None:
                return None
            elsewhere = not leased and leases.held_elsewhere(session, item_ids, owner)
        if leased and job.status == JobStatus.QUEUED:
            with unit_of_work(session):
                queries.mark_job_running(session, job_id)
        model = runtime.model_info(session, job.model, job.tenant)
        fallback = job_fallback(runtime, session, job.tenant, job.options)
    return Lease(
        job_id,
        chunk,
        item_ids,
        job.chunk_count,
        job.status in OPEN_JOB_STATUSES,
        model,
        leased,
        place=runtime.place(job.id, job.output),
        bulk=job.bulk,
        pipeline_id=job.pipeline_id,
        owner=owner,
        held_elsewhere=elsewhere,
        tenant=job.tenant,
        fallback=fallback,
    )


def _answer(
    runtime: WorkerRuntime, lease: Lease, report: ChunkReport, urgent: bool, keeper: LeaseKeeper
) -> list[_Work]:
    """Every leased input through the job's model, then those it failed or refused through the
    job's fallback model (if it names one and takes them)."""
    work = [_Work(item, time.monotonic()) for item in lease.items]
    _give_up_on_retried(work, runtime.settings.max_attempts)
    if work:
        _run(runtime, lease, lease.model, work, report, urgent, keeper)
    if work and lease.fallback is not None:
        _fall_back(runtime, lease, lease.fallback, work, report, urgent, keeper)
    _count(work, report)
    return work


def _run(
    runtime: WorkerRuntime,
    lease: Lease,
    model: ModelInfo,
    work: list[_Work],
    report: ChunkReport,
    urgent: bool,
    keeper: LeaseKeeper,
) -> None:
    """Load `model` (kept loaded while this runs), then run the work through its engine; a
    model that cannot load fails the work with the reason."""
    with ExitStack() as stack:
        try:
            runner = stack.enter_context(runtime.using(model))  # not unloaded while in use
        except TransientError:
            raise
        except Exception as error:
            where = {"job_id": lease.job_id, "chunk": lease.chunk, "model": model.ref}
            log.exception("model %s failed to load", model.ref, extra=where)
            for w in work:
                if w.error is None:
                    _fail(w, f"Model {model.ref!r} could not be loaded: {error}.", FAILED)
            return
        _through_engine(runtime, runner, lease, work, report, urgent, keeper)
    for w in work:
        if w.error is None and w.outputs is not None and not w.cancelled:
            w.answered_by = model


def _fall_back(
    runtime: WorkerRuntime,
    lease: Lease,
    fallback: Fallback,
    work: list[_Work],
    report: ChunkReport,
    urgent: bool,
    keeper: LeaseKeeper,
) -> None:
    """The inputs the job's model failed or refused (as `fallback.on` says) run again through
    the fallback model, fetched afresh: the model's own decoded rows are gone, and the two may
    prepare inputs differently. Its load failures, memory budget and batching apply as to any
    model; what it cannot answer fails with both reasons."""
    taken = [w for w in work if fallback.takes(w.failure)]
    if not taken or keeper.cancelled.is_set() or keeper.lost.is_set():
        return  # nothing to take, or nothing this run may still start
    again = [_Work(w.item, w.started) for w in taken]
    _run(runtime, lease, fallback.model, again, report, urgent, keeper)
    for first, second in zip(taken, again, strict=True):
        _settle(first, second, fallback.model)
    report.fell_back += sum(1 for w in taken if w.fallback_reason is not None)


def _settle(first: _Work, second: _Work, fallback: ModelInfo) -> None:
    """The input's result once its fallback ran: the fallback's answer, or both failures."""
    if second.cancelled:
        return  # the job was cancelled before the fallback started it: the first failure stands
    first.fallback_reason, first.digest = first.error, first.digest or second.digest
    if second.answered_by is not None:
        first.error, first.outputs = None, second.outputs
        first.cached, first.answered_by = second.cached, second.answered_by
    else:
        first.error = (
            f"{first.error} The fallback model {fallback.ref!r} failed too: {second.error}"
        )


def _fail(w: _Work, sentence: str, failure: Trigger) -> None:
    w.error, w.failure = sentence, failure


def _count(work: list[_Work], report: ChunkReport) -> None:
    report.processed = sum(1 for w in work if not w.cancelled)
    report.failed = sum(1 for w in work if w.error and not w.cancelled)
    report.succeeded = report.processed - report.failed


def _through_engine(
    runtime: WorkerRuntime,
    runner: ModelRunner,
    lease: Lease,
    work: list[_Work],
    report: ChunkReport,
    urgent: bool,
    keeper: LeaseKeeper,
) -> None:
    """Fetch, consult the content cache and decode on this thread, feeding the shared Batcher
    as rows become ready; then collect. Inputs are fetched a few at a time so a chunk of large
    images never sits in memory whole. A cancel seen between groups stops the rest."""
    with runner.batcher.expect(len(work), urgent) as announced:  # so the Batcher waits for these
        for start in range(0, len(work), FETCH_GROUP):
            group = work[start : start + FETCH_GROUP]
            if keeper.cancelled.is_set() or keeper.lost.is_set():
                _cancel(group, announced)
            else:
                report.cached += _feed(runtime, runner, lease, group, announced, report)
    timer = time.monotonic()
    for w in work:
        _collect(runner, w)
    report.seconds["infer"] += time.monotonic() - timer


def _feed(
    runtime: WorkerRuntime,
    runner: ModelRunner,
    lease: Lease,
    group: list[_Work],
    announced: Announcement[Prepared, Any],
    report: ChunkReport,
) -> int:
    """Fetch a group, answer what the cache knows, hand the rest to the Batcher; returns the
    cache hits."""
    timer = time.monotonic()
    for w in group:
        if w.waiting:
            started = time.monotonic()
            _fetch(runtime, w)
            w.seconds["fetch"] = time.monotonic() - started
    hits = _use_cache(runtime, lease.tenant, runner.info, group)
    report.seconds["fetch"] += time.monotonic() - timer
    for w in group:
        _submit(runner, announced, w, report)
    return hits


def _cancel(group: list[_Work], announced: Announcement[Prepared, Any]) -> None:
    """The job is cancelling: these inputs are never started."""
    for w in group:
        w.cancelled = True
    announced.skip(len(group))


def _give_up_on_retried(work: list[_Work], max_attempts: int) -> None:
    """An item leased more than `max_attempts` times keeps killing or losing its runs: fail
    it with the reason rather than letting it crash workers forever."""
    for w in work:
        if w.item.attempts > max_attempts:
            w.error = (
                f"Kiln gave up on this input after {max_attempts} attempts; each run stopped "
                "before finishing it (a worker crash, a lost lease or repeated transient errors)."
            )


def _fetch(runtime: WorkerRuntime, w: _Work) -> None:
    """The item's input: its text, or its bytes from wherever its source points."""
    try:
        if w.item.text is not None:
            w.data = w.item.text
        else:
            w.data = runtime.fetcher.fetch(w.item.source, runtime.settings.max_upload_bytes)
    except TransientError:
        raise  # the whole chunk retries with backoff; writes are idempotent
    except KilnError as error:
        w.error = str(error)
        return
    w.digest = sha256_hex(w.data)  # the results' sha256 column, and the content cache's key


def _use_cache(runtime: WorkerRuntime, tenant: str, model: ModelInfo, group: list[_Work]) -> int:
    """Answer the inputs this model version has already seen for this tenant (or any tenant,
    when the cache is shared); returns how many. `model` is the runner's: a registration
    identical to the job's (the same cache key, hence the same scope)."""
    digests = [w.digest for w in group if w.digest and w.waiting]
    if not digests or not runtime.settings.content_cache:
        return 0
    with runtime.sessions() as session:
        known = cache_rows.cached_results(
            session,
            content_cache.scope_key(runtime.settings, tenant, model),
            digests,
            runtime.settings.content_cache_ttl_s,
        )
    hits = 0
    for w in group:
        entry = known.get(w.digest or "")
        if entry is not None and w.waiting:
            w.outputs, w.cached, w.data = content_cache.decode(*entry), True, None
            hits += 1
    return hits


def _submit(
    runner: ModelRunner, announced: Announcement[Prepared, Any], w: _Work, report: ChunkReport
) -> None:
    if not w.waiting or w.data is None:
        announced.skip()
        return
    timer = time.monotonic()
    try:
        w.prepared = runner.pipeline.prepare(w.data)
    except KilnError as error:
        _fail(w, str(error), FAILED)
    except Exception as error:  # a decoder bug must fail one item, not the worker
        where = {"job_id": w.item.job_id, "chunk": w.item.chunk, "item": w.item.key}
        log.exception("preparing %s failed", w.item.key, extra=where)
        _fail(w, f"The input could not be prepared: {error}.", FAILED)
    finally:
        w.data = None  # the decoded rows are all the engine needs
        w.seconds["decode"] = time.monotonic() - timer
        report.seconds["decode"] += w.seconds["decode"]
    if w.prepared is None:
        announced.skip()
        return
    w.submitted = time.monotonic()
    w.future = announced.submit(w.prepared)
    w.future.add_done_callback(lambda _: setattr(w, "answered", time.monotonic()))


def _collect(runner: ModelRunner, w: _Work) -> None:
    if w.future is None or w.prepared is None:
        return
    try:
        answer = w.future.result()
        # result() can return before the future's callbacks have run: then it answered just now
        answered = w.answered or time.monotonic()
        w.seconds["engine"] = max(0.0, answered - w.submitted)  # its batch filling, then running
        started = time.monotonic()
        w.outputs = runner.pipeline.finish(w.prepared, answer)
        w.seconds["post"] = time.monotonic() - started
    except TransientError:
        raise  # a stuck engine (past its batch deadline): the whole chunk runs again
    except Refusal as refusal:  # "no answer", which a fallback may take
        _fail(w, str(refusal), REFUSED)
    except KilnError as error:  # the input itself (an image that did not decode on the GPU)
        _fail(w, str(error), FAILED)
    except Exception as error:
        where = {"job_id": w.item.job_id, "chunk": w.item.chunk, "item": w.item.key}
        log.warning("inference failed for %s: %s", w.item.key, error, extra=where)
        _fail(w, f"The model failed on this input: {error}.", FAILED)


def _tally(runtime: WorkerRuntime, lease: Lease, work: list[_Work], report: ChunkReport) -> None:
    """This run's items by final status and its stage times, for the worker's metrics."""
    statuses = Counter(str(_status(w)) for w in work)
    runtime.chunk_stats.record(lease.model.ref, statuses, report.seconds, report.cached)


def _result_rows(work: list[_Work], stages: bool = False) -> list[ResultRow]:
    """With `stages` (interactive chunks, whose users watch one answer), each row carries its
    milliseconds per stage; a bulk item's would cost a column per row nobody reads."""
    return [
        ResultRow(
            key=w.item.key,
            status=_status(w),
            error="The job was cancelled." if w.cancelled else w.error,
            duration_ms=round((time.monotonic() - w.started) * 1000, 2),
            outputs=None if w.error or w.cancelled else w.outputs,
            sha256=w.digest,
            answered_by=w.answered_by.ref if w.answered_by else None,
            fallback_reason=w.fallback_reason,
            stages_ms=_stages_ms(w) if stages else None,
        )
        for w in work
    ]


def _stages_ms(w: _Work) -> dict[str, float] | None:
    return {k: round(v * 1000, 2) for k, v in w.seconds.items()} or None


def _status(w: _Work) -> ItemStatus:
    if w.cancelled:
        return ItemStatus.CANCELLED
    return ItemStatus.FAILED if w.error else ItemStatus.SUCCEEDED
