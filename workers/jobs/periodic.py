"""What `kiln beat` sends periodically: the reconciler and the schedule tick. Each write is one
unit of work (the commit rule: app/__init__.py); a chunk is marked sent after its message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from kiln.app.db import chunk_runs, content_cache, leases
from kiln.app.db import ingest as db
from kiln.app.db.models import utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.jobs import fair_share, schedules
from kiln.workers.close.close import close_finished_job
from kiln.workers.jobs import retention
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

Chunk = tuple[str, int]  # (job id, chunk number)
InFlight = Callable[[], set[Chunk] | None]  # the broker's chunk messages; None = unknown
RUN_ROWS_KEPT_S = 600.0  # a chunk run's progress row outlives its silent worker this long
PURGE_STEPS = 100  # content-cache purge steps per reconcile: a backlog waits for the next one


def reconcile(
    runtime: WorkerRuntime, dispatcher: Dispatcher, in_flight: InFlight
) -> dict[str, Any]:
    """Postgres is the truth, Redis only carries work: find what the broker lost and send it.

    - an ingest silent too long is resumed after its last committed key;
    - running items whose lease ran out (a killed worker) go back to pending and are re-sent;
    - pending chunks with no message queued or recently delivered (Redis flushed or
      restarted) are re-sent. Duplicates are harmless: a copy finds the items leased or done;
    - bulk chunks recorded and not sent are sent up to the fair share (a top-up a crash or
      a failure missed: app/jobs/fair_share.py);
    - open jobs whose items have all ended are closed (their manifest written);
    - content-cache entries past their time to live, or the oldest above the cap, are deleted;
    - closed jobs get their expiry, and expired jobs' results and items are deleted, a bounded
      amount per tick (`workers/jobs/retention.py`).
    """
    with runtime.sessions() as session:
        stalled = db.stalled_ingests(session, runtime.settings.ingest_stale_s)
    for job_id in stalled:
        log.warning("ingest %s is silent; sending a new step to resume it", job_id)
        dispatcher.enqueue_ingest(job_id)
    return {
        "ingests_resumed": len(stalled),
        **_resend_chunks(runtime, dispatcher, in_flight),
        "chunks_topped_up": fair_share.top_up(runtime.sessions, dispatcher, runtime.settings),
        "jobs_closed": _close_ended_jobs(runtime),
        "cache_purged": purge_content_cache(runtime),
        "runs_forgotten": _forget_dead_runs(runtime),
        **retention.sweep(runtime),
    }


def _forget_dead_runs(runtime: WorkerRuntime) -> int:
    """Progress rows of chunk runs whose worker died (no keeper touched them for a lease and
    more): a job's progress already ignores them; this keeps the table small."""
    older = utcnow() - timedelta(seconds=max(RUN_ROWS_KEPT_S, 2 * runtime.settings.lease_s))
    with runtime.sessions() as session, unit_of_work(session):
        return chunk_runs.purge(session, older)


def purge_content_cache(runtime: WorkerRuntime) -> int:
    """Expired and surplus content-cache entries, deleted a step (one short transaction) at a
    time so no lock is held long; returns how many."""
    settings = runtime.settings
    purged = 0
    for _ in range(PURGE_STEPS):
        with runtime.sessions() as session, unit_of_work(session):
            step = content_cache.purge(
                session,
                settings.content_cache_ttl_s,
                settings.content_cache_max_entries,
                content_cache.PURGE_BATCH,
            )
        purged += step.total
        if step.total < content_cache.PURGE_BATCH:
            break
    if purged:
        log.info("content cache: purged %d entries", purged)
    return purged


def _close_ended_jobs(runtime: WorkerRuntime) -> int:
    """Jobs whose items have all ended but which nobody closed (a chunk's run stopped between
    committing its results and closing the job)."""
    with runtime.sessions() as session:
        ended = leases.ended_open_jobs(session)
    closed = 0
    for job_id in ended:
        if close_finished_job(runtime, job_id) is not None:
            log.warning("job %s had ended unclosed; closed it", job_id)
            closed += 1
    return closed


def _resend_chunks(
    runtime: WorkerRuntime, dispatcher: Dispatcher, in_flight: InFlight
) -> dict[str, int]:
    with runtime.sessions() as session:
        with unit_of_work(session):
            expired = leases.reset_expired(session)
        stranded = leases.stranded_chunks(session, runtime.settings.redispatch_after_s)
    if not stranded:
        return {"chunks_expired": len(expired), "chunks_resent": 0}
    flying = in_flight()
    resent = 0
    for chunk in stranded:
        where = (chunk.job_id, chunk.chunk)
        if where not in expired and (flying is None or where in flying):
            continue
        log.warning("chunk %s/%d has no live run or message; sending it again", *where)
        dispatcher.enqueue_chunk(chunk.job_id, chunk.chunk, chunk.item_ids, chunk.queue)
        with runtime.sessions() as session, unit_of_work(session):
            leases.mark_sent(session, chunk.item_ids)
        resent += 1
    return {"chunks_expired": len(expired), "chunks_resent": resent}


def run_due_schedules(runtime: WorkerRuntime, dispatcher: Dispatcher) -> dict[str, Any]:
    with runtime.sessions() as session:
        started = schedules.run_due(session, dispatcher)
    return {"started": started}
