"""What `kiln beat` sends periodically: the reconciler and the schedule tick. Each write is one
unit of work (the commit rule: app/__init__.py); a chunk is marked sent after its message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kiln.app import schedules
from kiln.app.db import ingest as db
from kiln.app.db import leases
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher
from kiln.workers.celery.inflight import Chunk
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

InFlight = Callable[[], set[Chunk] | None]  # the broker's chunk messages; None = unknown


def reconcile(
    runtime: WorkerRuntime, dispatcher: Dispatcher, in_flight: InFlight
) -> dict[str, Any]:
    """Postgres is the truth, Redis only carries work: find what the broker lost and send it.

    - an ingest silent too long is resumed after its last committed key;
    - running items whose lease ran out (a killed worker) go back to pending and are re-sent;
    - pending chunks with no message queued or recently delivered (Redis flushed or
      restarted) are re-sent. Duplicates are harmless: a copy finds the items leased or done.
    """
    with runtime.sessions() as session:
        stalled = db.stalled_ingests(session, runtime.settings.ingest_stale_s)
    for job_id in stalled:
        log.warning("ingest %s is silent; sending a new step to resume it", job_id)
        dispatcher.enqueue_ingest(job_id)
    return {"ingests_resumed": len(stalled), **_resend_chunks(runtime, dispatcher, in_flight)}


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
