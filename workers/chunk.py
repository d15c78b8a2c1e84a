"""Process one chunk of a job: lease → fetch + decode → batch → write results.

A plain function of a `WorkerRuntime`: the Celery task is a thin adapter over it, and tests
call it without a broker. Every write is idempotent, so a redelivered chunk is harmless.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from app import results
from app.catalog import get_model
from app.core.errors import KilnError, NotFoundError, TransientError
from app.db import queries
from app.db.models import Item, ItemStatus, Job, aware, utcnow
from workers.models.base import Prepared
from workers.models.loader import output_fields
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
    with runtime.sessions() as session:
        job = queries.lock_job(session, job_id)
        if job is None:
            log.warning("chunk %s/%d: job no longer exists; dropping", job_id, chunk)
            return report
        leased = queries.lease_items(session, job_id, item_ids)
        if leased:
            queries.mark_job_running(session, job_id)
        session.commit()
        model = get_model(session, job.model)
    if leased:
        work = _run(runtime, model, leased, report)
        _write(runtime, job_id, work)
    report.job_status = _finish(runtime, job_id, chunk, item_ids, model)
    return report


def _run(runtime: WorkerRuntime, model: Any, items: list[Item], report: ChunkReport) -> list[_Work]:
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
    for w in work:
        _prepare(runtime, runner, w)
    report.seconds["fetch_decode"] = time.monotonic() - timer
    timer = time.monotonic()
    for w in work:
        _collect(runner, w)
    report.seconds["infer_finish"] = time.monotonic() - timer
    report.processed = len(work)
    report.failed = sum(1 for w in work if w.error)
    report.succeeded = report.processed - report.failed
    return work


def _prepare(runtime: WorkerRuntime, runner: ModelRunner, w: _Work) -> None:
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
    w.future = runner.batcher.submit(w.prepared)


def _collect(runner: ModelRunner, w: _Work) -> None:
    if w.future is None or w.prepared is None:
        return
    try:
        w.outputs = runner.pipeline.finish(w.prepared, w.future.result())
    except Exception as error:
        log.warning("inference failed for %s: %s", w.item.key, error)
        w.error = f"The model failed on this input: {error}."


def _write(runtime: WorkerRuntime, job_id: str, work: list[_Work]) -> None:
    now = utcnow()
    rows = [
        {
            "key": w.item.key,
            "chunk": w.item.chunk,
            "status": ItemStatus.FAILED if w.error else ItemStatus.SUCCEEDED,
            "error": w.error,
            "outputs": w.outputs,
            "duration_ms": round((time.monotonic() - w.started) * 1000, 2),
            "finished_at": now,
        }
        for w in work
    ]
    with runtime.sessions() as session:
        queries.upsert_results(session, job_id, rows)
        session.commit()


def _finish(
    runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int], model: Any
) -> str | None:
    """Write the chunk's shard from what the database holds, then close the job if done.

    Shards are complete before the job is closed, so a reader who sees `completed` gets every
    row; a replay after a crash (or a failed manifest write) finishes what was left undone.
    """
    fields = output_fields(model)
    with runtime.sessions() as session:
        done = queries.finished_items(session, item_ids)
        if done:
            results.write_shard(runtime.store, job_id, chunk, done, fields)
        if queries.has_open_items(session, job_id):
            return None
        _write_missing_shards(runtime, session, job_id, fields)
        final = queries.finish_job_if_done(session, job_id)
        session.commit()
        job = session.get(Job, job_id)
        if job is None or queries.is_open(job):
            return final
        if final or not runtime.store.exists(results.manifest_key(job_id)):
            _write_manifest(runtime, session, job)
    return final


def _write_missing_shards(
    runtime: WorkerRuntime, session: Any, job_id: str, fields: list[Any]
) -> None:
    """Another chunk may have committed its results and not yet written its shard."""
    written = set(results.shard_keys(runtime.store, job_id))
    for chunk in queries.job_chunks(session, job_id):
        if results.shard_key(job_id, chunk) not in written:
            items = queries.chunk_items(session, job_id, chunk)
            results.write_shard(runtime.store, job_id, chunk, items, fields)


def _write_manifest(runtime: WorkerRuntime, session: Any, job: Job) -> None:
    counts = queries.job_counts(session, job.id)
    runner = runtime.runners().get(job.model)
    results.write_manifest(
        runtime.store,
        job.id,
        {
            "job_id": job.id,
            "model": job.model,
            "status": job.status,
            "engine": runner.pipeline.backend if runner else None,
            "counts": {
                "total": counts.total,
                "succeeded": counts.succeeded,
                "failed": counts.failed,
                "cancelled": counts.cancelled,
            },
            "created_at": _iso(job.created_at),
            "finished_at": _iso(job.finished_at),
        },
    )
    log.info("job %s %s: %s", job.id, job.status, counts)


def _iso(value: datetime | None) -> str | None:
    stamp = aware(value)
    return stamp.isoformat() if stamp else None
