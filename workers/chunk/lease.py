"""The first and the last word of a chunk run with the database: take the chunk's items (the
`Lease`: what the run learned of its items and its job), and give them back when the run
fails, so the task's retry can take them at once. While the run works, the process's lease
keeper (`keeper.py`) renews the lease.
"""

from __future__ import annotations

import logging
from typing import Any

from kiln.app import video
from kiln.app.core.config import Settings
from kiln.app.core.errors import KilnError, SetupError, plain_reason
from kiln.app.db import leases, queries
from kiln.app.db.models import OPEN_JOB_STATUSES, JobStatus
from kiln.app.db.session import unit_of_work
from kiln.workers.close.fallback import job_fallback
from kiln.workers.close.lease import Lease
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def take(
    runtime: WorkerRuntime, job_id: str, chunk: int, item_ids: list[int], owner: str
) -> Lease | None:
    """Take the chunk's open items and read the job (no lock on its row), then mark the job
    running if it was queued (its own unit: the job row is locked after the items, never
    while holding them); None when the job no longer exists."""
    settings = runtime.settings
    with runtime.sessions() as session:
        with unit_of_work(session):
            taken = leases.take_chunk(
                session, job_id, chunk, item_ids, owner, settings.lease_s, settings.max_attempts
            )
        if taken is None:
            return None
        job = taken.job
        if taken.items and job.status == JobStatus.QUEUED:
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
        taken.items,
        place=runtime.place(job.id, job.output),
        bulk=job.bulk,
        pipeline_id=job.pipeline_id,
        owner=owner,
        held_elsewhere=taken.held_elsewhere,
        tenant=job.tenant,
        fallback=fallback,
        sampling=job_sampling(settings, job.options),
        cancelling=job.status == JobStatus.CANCELLING,
        failed=job.status == JobStatus.FAILED,
    )


def release(
    runtime: WorkerRuntime, job_id: str, owner: str, error: BaseException | None = None
) -> None:
    """Give the run's items back (its lease ends now rather than when it runs out), with the
    `error` that stopped the run as their reason, should Kiln give up on them; a run stopped
    by Kiln's own setup (`SetupError`) does not count against them."""
    reason = stop_reason(error) if error is not None else None
    charged = not isinstance(error, SetupError)
    try:
        with runtime.sessions() as session, unit_of_work(session):
            leases.release(session, job_id, owner, reason, charged)
    except Exception as error:  # the database is away: the lease simply runs out
        log.warning(
            "could not release lease %s of job %s: %s", owner, job_id, error,
            extra={"job_id": job_id},
        )  # fmt: skip


def stop_reason(error: BaseException) -> str:
    """What stopped a run, in a sentence for its items: Kiln's own for its errors, the
    exception's kind and first line for the rest (a bug, a driver's fault)."""
    if isinstance(error, KilnError):
        return str(error)
    kind, words = type(error).__name__, plain_reason(error)
    return f"The run stopped with {kind}" + ("." if words == kind else f": {words}.")


def job_sampling(settings: Settings, options: dict[str, Any] | None) -> video.Sampling:
    """How a job samples its videos: its `video_fps` (default 1), within this worker's limits."""
    fps = (options or {}).get(video.FPS_OPTION, video.DEFAULT_FPS)
    limits = video.VideoLimits(settings.max_video_frames, settings.max_video_duration_s)
    return video.Sampling(float(fps), limits)
