"""Process one chunk of a job: lease → fetch + decode → batch → write results.

A plain function of a `WorkerRuntime`: the Celery task is a thin adapter over it, and tests
call it without a broker. Every write is idempotent, so a redelivered chunk is harmless.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from app.catalog import ModelInfo
from app.core.errors import KilnError, NotFoundError, TransientError
from app.db import queries
from app.db.models import Item, ItemStatus, JobStatus
from app.results import ResultRow
from workers.batching import Announcement
from workers.finish import Lease, finish_chunk
from workers.models.base import Prepared
from workers.runtime import ModelRunner, WorkerRuntime

log = logging.getLogger(__name__)


@dataclass
class ChunkReport:
    job_id: str
    chunk: int
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    job_status: str | None = None


@dataclass
class _Work:
    item: Item
    started: float
    prepared: Prepared | None = None
    future: Future[Any] | None = None
    outputs: dict[str, Any] | None = None
    error: str | None = None


def process_chunk(
    runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int]
) -> ChunkReport:
    report = ChunkReport(job_id, chunk)
    lease = _lease(runtime, job_id, chunk, item_ids)
    if lease is None:
        log.warning("chunk %s/%d: job no longer exists; dropping", job_id, chunk)
        return report
    rows: list[ResultRow] = []
    if lease.items:
        rows = _result_rows(_run(runtime, lease.model, lease.items, report))
    report.job_status = finish_chunk(runtime, lease, rows)
    return report


def _lease(runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int]) -> Lease | None:
    """One transaction: lock the job, take the chunk's open items, mark the job running."""
    with runtime.sessions() as session:
        job = queries.lock_job(session, job_id)
        if job is None:
            return None
        leased = queries.lease_items(session, job_id, item_ids)
        was_open = queries.is_open(job)
        if leased and job.status == JobStatus.QUEUED:
            queries.mark_job_running(session, job_id)
        session.commit()
        model = runtime.model_info(session, job.model)
        return Lease(job_id, chunk, item_ids, job.chunk_count, was_open, model, leased)


def _run(
    runtime: WorkerRuntime, model: ModelInfo, items: list[Item], report: ChunkReport
) -> list[_Work]:
    """Fetch and decode on this thread, feeding the shared Batcher as rows become ready."""
    work = [_Work(item, time.monotonic()) for item in items]
    try:
        runner = runtime.runner(model)
    except TransientError:
        raise
    except Exception as error:
        log.exception("model %s failed to load", model.name)
        for w in work:
            w.error = f"Model {model.name!r} could not be loaded: {error}."
        return work
    timer = time.monotonic()
    with runner.batcher.expect(len(work)) as announced:  # so the Batcher waits for these
        for w in work:
            _prepare(runtime, runner, announced, w)
    report.seconds["fetch_decode"] = time.monotonic() - timer
    timer = time.monotonic()
    for w in work:
        _collect(runner, w)
    report.seconds["infer_finish"] = time.monotonic() - timer
    report.processed = len(work)
    report.failed = sum(1 for w in work if w.error)
    report.succeeded = report.processed - report.failed
    return work


def _prepare(
    runtime: WorkerRuntime, runner: ModelRunner, announced: Announcement[Prepared, Any], w: _Work
) -> None:
    try:
        data = runtime.fetcher.fetch(w.item.source, runtime.settings.max_upload_bytes)
        w.prepared = runner.pipeline.prepare(data)
    except TransientError:
        raise  # the whole chunk retries with backoff; writes are idempotent
    except (KilnError, NotFoundError) as error:
        w.error = str(error)
        return
    except Exception as error:  # a decoder bug must fail one item, not the worker
        log.exception("preparing %s failed", w.item.key)
        w.error = f"The input could not be prepared: {error}."
        return
    w.future = announced.submit(w.prepared)


def _collect(runner: ModelRunner, w: _Work) -> None:
    if w.future is None or w.prepared is None:
        return
    try:
        w.outputs = runner.pipeline.finish(w.prepared, w.future.result())
    except Exception as error:
        log.warning("inference failed for %s: %s", w.item.key, error)
        w.error = f"The model failed on this input: {error}."


def _result_rows(work: list[_Work]) -> list[ResultRow]:
    return [
        ResultRow(
            key=w.item.key,
            status=ItemStatus.FAILED if w.error else ItemStatus.SUCCEEDED,
            error=w.error,
            duration_ms=round((time.monotonic() - w.started) * 1000, 2),
            outputs=w.outputs,
        )
        for w in work
    ]
