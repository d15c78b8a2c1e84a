"""Process one chunk of a job: lease → prep → batch → engine → write.

A plain function of a `WorkerRuntime`: the Celery task is a thin adapter over it, and tests
call it without a broker. Each stage is handed what it needs: the lease (one unit of work),
the rows as columns (`ChunkRows`), a `Stage` per model (its runner, the prep processes, the
lease to watch), and the writer (`finish_chunk`: shard, one statement, close). Every write is
idempotent, so a redelivered chunk is harmless. A job with a fallback model has the inputs its
model failed or refused run again through the fallback, in the same run, before anything is
written.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import numpy as np

from kiln.app.catalog import ModelInfo
from kiln.app.core.errors import TransientError
from kiln.app.db import content_cache as cache_rows
from kiln.app.db import leases, queries
from kiln.app.db.models import OPEN_JOB_STATUSES, JobStatus
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.families.fallback import FAILED
from kiln.app.observability.tracing import annotate
from kiln.workers.chunk import content_cache
from kiln.workers.chunk.answer import Stage, drop_held, read_all, run_model
from kiln.workers.chunk.expand import expand_videos, job_sampling
from kiln.workers.chunk.fallback import Fallback, job_fallback
from kiln.workers.chunk.finish import Lease, finish_chunk
from kiln.workers.chunk.lease import Held
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.chunk.stats import STAGES
from kiln.workers.models.loader import output_fields
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass
class ChunkReport:
    job_id: str
    chunk: int
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    cached: int = 0  # answered from the content cache
    fell_back: int = 0  # taken by the job's fallback model (answered or failed again)
    # fetch and decode (CPU seconds of the prep processes, summed over items), infer (the
    # chunk's wall time in the model), write (shard, results, close)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    job_status: str | None = None


def process_chunk(
    runtime: WorkerRuntime,
    job_id: str,
    chunk: int,
    item_ids: list[int],
    urgent: bool = False,
    owner: str | None = None,
    dispatcher: Dispatcher | None = None,
) -> ChunkReport:
    """`urgent`: an interactive chunk, whose rows go ahead of bulk rows in the Batcher.
    `owner`: this run's lease token (new per run, so a redelivered copy of a message that is
    still running elsewhere finds the items held and drops out). `dispatcher`: sends the
    chunks of a video's frames (without one, the reconciler sends them)."""
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
    try:
        with runtime.leases.hold(job_id, owner, watched=bool(lease.items)) as held:
            if lease.cancelling:  # items a retry or the reconciler handed back: none runs
                held.stop(held.cancelled)
            rows = answer_chunk(runtime, lease, held, urgent, report)
            if not held.lost.is_set():
                rows = expand_videos(runtime, lease, rows, dispatcher)
                lease = replace(lease, items=rows.items)  # a video item left: its frames are new
                _count(rows, report)
            if held.lost.is_set():
                log.warning(
                    "chunk %s/%d: lease lost; another run owns the results", job_id, chunk,
                    extra=where,
                )  # fmt: skip
                return report
            timer = time.monotonic()
            held.writing = True
            report.job_status = finish_chunk(runtime, lease, rows, stages=urgent)
            report.seconds["write"] = time.monotonic() - timer
            _tally(runtime, lease, rows, report)
    except BaseException:
        _release(runtime, job_id, owner)  # so the task's retry can take the items at once
        raise
    return report


def answer_chunk(
    runtime: WorkerRuntime, lease: Lease, held: Held, urgent: bool, report: ChunkReport
) -> ChunkRows:
    """Every leased input through the job's model, then those it failed or refused through the
    job's fallback model (if it names one and takes them)."""
    rows = ChunkRows(lease.items)
    _give_up_on_retried(rows, runtime.settings.max_attempts)
    _run(runtime, lease, lease.model, rows, rows.open(), held, urgent, report)
    if lease.fallback is not None:
        _fall_back(runtime, lease, lease.fallback, rows, held, urgent, report)
    report.seconds["fetch"] = float(rows.seconds[:, 0].sum())
    report.seconds["decode"] = float(rows.seconds[:, 1].sum())
    _count(rows, report)
    return rows


def _count(rows: ChunkRows, report: ChunkReport) -> None:
    statuses = Counter(rows.statuses())
    report.processed = len(rows) - statuses["cancelled"]
    report.failed = statuses["failed"]
    report.succeeded = report.processed - report.failed


def _run(
    runtime: WorkerRuntime,
    lease: Lease,
    model: ModelInfo,
    rows: ChunkRows,
    indices: np.ndarray,
    held: Held,
    urgent: bool,
    report: ChunkReport,
) -> None:
    """Load `model` (kept loaded while this runs), then run `indices` through it; a model
    that cannot load fails them with the reason."""
    if not len(indices):
        return
    started = time.monotonic()
    with ExitStack() as stack:
        try:
            runner = stack.enter_context(runtime.using(model))  # not unloaded while in use
        except TransientError:
            raise
        except Exception as error:
            where = {"job_id": lease.job_id, "chunk": lease.chunk, "model": model.ref}
            log.exception("model %s failed to load", model.ref, extra=where)
            for row in indices.tolist():
                rows.fail(row, f"Model {model.ref!r} could not be loaded: {error}.", FAILED)
            return
        stage = Stage(
            model, runner, runtime.prep(), runtime.settings.max_upload_bytes, held, urgent,
            lease.sampling,
        )  # fmt: skip
        holder: dict[int, int] = {}
        if runtime.settings.content_cache:
            holder = read_all(stage, rows, indices)
            indices = _use_cache(runtime, lease.tenant, model, runner.info, rows, indices, report)
            drop_held(stage, rows, [r for r in holder if rows.cached[r]], holder)
        run_model(stage, rows, indices, holder)
    report.seconds["infer"] += time.monotonic() - started


def _use_cache(
    runtime: WorkerRuntime,
    tenant: str,
    model: ModelInfo,
    loaded: ModelInfo,
    rows: ChunkRows,
    indices: np.ndarray,
    report: ChunkReport,
) -> np.ndarray:
    """One lookup for the rows read: what this model version has already answered for this
    tenant (or anyone, when the cache is shared) becomes a piece of the results. `loaded`
    is the runner's registration, identical to the job's (the same cache key and scope).
    Returns the rows still to run."""
    going = [r for r in indices.tolist() if rows.errors[r] is None and not rows.cancelled[r]]
    readable = [row for row in going if rows.sha256[row]]
    # Videos and their frames are not hashed whole: they run without the cache.
    unhashed = [row for row in going if not rows.sha256[row]]
    if not readable:
        return np.asarray(unhashed, dtype=np.int64)
    settings = runtime.settings
    with runtime.sessions() as session:
        known = cache_rows.cached_results(
            session,
            content_cache.scope_key(settings, tenant, loaded),
            [rows.sha256[row] or "" for row in readable],
            settings.content_cache_ttl_s,
        )
    hits = [row for row in readable if rows.sha256[row] in known]
    if hits:
        rows.cached[hits] = True
        entries = [known[rows.sha256[row] or ""] for row in hits]
        piece = content_cache.hits_piece(np.asarray(hits), entries, output_fields(model), model)
        rows.answer(piece)
        report.cached += len(hits)
    hit = set(hits)
    return np.asarray(sorted(unhashed + [r for r in readable if r not in hit]), dtype=np.int64)


def _fall_back(
    runtime: WorkerRuntime,
    lease: Lease,
    fallback: Fallback,
    rows: ChunkRows,
    held: Held,
    urgent: bool,
    report: ChunkReport,
) -> None:
    """The inputs the job's model failed or refused (as `fallback.on` says) run again through
    the fallback model, fetched afresh: the model's own decoded rows are gone, and the two may
    prepare inputs differently. Its load failures, memory budget and batching apply as to any
    model; what it cannot answer fails with both reasons."""
    taken = [row for row in range(len(rows)) if fallback.takes(rows.failure[row])]
    if not taken or held.stopping():
        return  # nothing to take, or nothing this run may still start
    first = {row: rows.errors[row] for row in taken}
    for row in taken:
        rows.errors[row] = rows.failure[row] = None
    _run(runtime, lease, fallback.model, rows, np.asarray(taken), held, urgent, report)
    for row in taken:
        if rows.cancelled[row]:  # cancelled before the fallback started it: the first stands
            rows.cancelled[row] = False
            rows.fail(row, first[row] or "", None)
            continue
        rows.fallback_reason[row] = first[row]
        report.fell_back += 1
        if rows.answered_by[row] is None:
            again = rows.errors[row]
            ref = fallback.model.ref
            rows.fail(row, f"{first[row]} The fallback model {ref!r} failed too: {again}")


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
        sampling=job_sampling(settings, job.options),
        cancelling=job.status == JobStatus.CANCELLING,
    )


def _give_up_on_retried(rows: ChunkRows, max_attempts: int) -> None:
    """An item leased more than `max_attempts` times keeps killing or losing its runs: fail
    it with the reason rather than letting it crash workers forever."""
    for row, item in enumerate(rows.items):
        if item.attempts > max_attempts:
            rows.fail(
                row,
                f"Kiln gave up on this input after {max_attempts} attempts; each run stopped "
                "before finishing it (a worker crash, a lost lease or repeated transient errors).",
            )


def _tally(runtime: WorkerRuntime, lease: Lease, rows: ChunkRows, report: ChunkReport) -> None:
    """This run's items by final status and its stage times, for the worker's metrics."""
    statuses = Counter(str(status) for status in rows.statuses())
    runtime.chunk_stats.record(lease.model.ref, statuses, report.seconds, report.cached)
