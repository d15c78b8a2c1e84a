"""A closed job's manifest: its counts, times, engine, options and what its close steps added,
beside the shard keys — written by whoever closed the job (`close.close_job`), or healed by a
later replay. What it says, from what the close read and wrote; the close stores it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kiln.app.db.models import aware
from kiln.app.db.queries import Closing, Finished
from kiln.app.families.fallback import FallbackOptions


def manifest_of(
    found: Closing,
    finished: Finished | None,
    engine: str | None,
    steps: dict[str, Any],
    deleted: str | None,
) -> dict[str, Any]:
    """What the manifest says of the job `found` read (`finished`: what its close set, when
    the caller closed it; `steps`: what its close steps added; `deleted`: the key of the
    objects its source lost, where the run wrote them), less its shard keys."""
    job, counts = found.job, found.counts
    started = finished.started_at if finished else job.started_at
    ended = finished.finished_at if finished else job.finished_at
    manifest = {
        "job_id": job.id,
        "model": job.model,
        "status": finished.status if finished else job.status,
        "engine": engine,
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
        "started_at": _iso(started),
        "finished_at": _iso(ended),
        "seconds": _seconds(started, ended),
        "source": job.source,
        "error": job.error,
    }
    if deleted is not None:
        manifest["deleted_keys"] = deleted
    if (fallback := (job.options or {}).get("fallback")) is not None:
        # the model (its exact version) and the failures it takes
        manifest["fallback"] = FallbackOptions.model_validate(fallback).model_dump()
    return manifest | steps


def _seconds(started: datetime | None, finished: datetime | None) -> float | None:
    started, finished = aware(started), aware(finished)
    return round((finished - started).total_seconds(), 3) if started and finished else None


def _iso(value: datetime | None) -> str | None:
    stamp = aware(value)
    return stamp.isoformat() if stamp else None
