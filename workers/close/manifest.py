"""A closed job's manifest: its counts, times, engine, options and what its close steps added,
beside the shard keys — written by whoever closed the job, or healed by a later replay.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from kiln.app import results
from kiln.app.catalog import ModelInfo
from kiln.app.db import queries
from kiln.app.db.models import Job, aware
from kiln.app.families.fallback import FallbackOptions
from kiln.workers.close.steps import close_steps
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def ensure_manifest(
    runtime: WorkerRuntime,
    session: Session,
    job_id: str,
    model: ModelInfo,
    closed_now: bool,
    shards: list[str] | None,
    steps: dict[str, Any] | None = None,
) -> None:
    """The closed job's manifest, unless a replay finds it written. `steps`: what the close
    steps added, when they ran before the close (else they run now)."""
    # Fresh from the database: the caller's session may hold the job as it was before it closed
    # (the ingest's close of a rerun with nothing to process).
    job = queries.job_as_now(session, job_id)
    if job is None or queries.is_open(job):
        return
    place = runtime.place(job.id, job.output)
    if not closed_now and place.store.exists(results.manifest_key(place)):
        return
    counts = queries.job_counts(session, job_id)
    runner = runtime.models.runners().get(model.cache_key)
    manifest = {
        "job_id": job.id,
        "model": job.model,
        "status": job.status,
        "engine": runner.predictor.backend if runner else None,
        "counts": {
            "total": counts.total,
            "succeeded": counts.succeeded,
            "failed": counts.failed,
            "cancelled": counts.cancelled,
            "skipped": counts.skipped,
            "deleted": counts.deleted,
            "known_failed": counts.known_failed,
            "excluded": counts.excluded,
            "fell_back": counts.fell_back,
            "fell_back_succeeded": counts.fell_back_succeeded,
        },
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "seconds": _seconds(job),
        "source": job.source,
        "error": job.error,
    }
    if counts.deleted and place.store.exists(results.deleted_key(place)):
        manifest["deleted_keys"] = results.deleted_key(place)
    if (fallback := (job.options or {}).get("fallback")) is not None:
        # the model (its exact version) and the failures it takes
        manifest["fallback"] = FallbackOptions.model_validate(fallback).model_dump()
    if steps is None:
        steps = close_steps(runtime.store, session, job, model, place)
    results.write_manifest(place, manifest | steps, shards)
    log.info("job %s %s: %s", job.id, job.status, counts)


def _seconds(job: Job) -> float | None:
    started, finished = aware(job.started_at), aware(job.finished_at)
    return round((finished - started).total_seconds(), 3) if started and finished else None


def _iso(value: datetime | None) -> str | None:
    stamp = aware(value)
    return stamp.isoformat() if stamp else None
