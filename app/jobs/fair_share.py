"""Fair share between tenants on the bulk queue.

The bulk queue is a FIFO (Celery over Redis): whatever is in it runs in the order it was sent.
So Kiln decides *what to send*, not what to take: a bulk job's ingest records its chunks
(items in Postgres) as before, but a chunk's message goes out only while its tenant's chunks in
flight (sent, not all items finished) are under the tenant's share of a fleet-wide window:

    window  = KILN_FAIR_SHARE_WINDOW_PER_SLOT × task threads × live workers (worker_facts)
    share   = the window split over the tenants with open bulk work by their `share_weight`
              (`tenant_settings`; 1 without a row), max-min fair: a tenant that needs less
              than its share leaves the rest to the others, so one tenant alone gets it all
    per job = the tenant's share split evenly over its open bulk jobs, the same way

The rest wait unsent (`ingests.chunks_sent` is how far a job's messages went). Whoever sees a
bulk chunk finish tops up (`top_up`: one read of the open bulk jobs, then one short unit per
job that has room), as do the ingest after each page and the reconciler, so a tenant whose job
arrives behind another's backlog waits only for the window's chunks ahead of it, not the
backlog. Interactive work is untouched: its queue is read first.

Sending stays at-least-once: a chunk is recorded sent in the unit that sent it (the job's
ingest row locked, so two top-ups of one job queue rather than both send); a crash between the
send and that commit sends it again, which a duplicate run shrugs off.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.db import fair_share as db
from kiln.app.db import leases
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher

log = logging.getLogger(__name__)

LIVE_FOR_S = 30.0  # a worker silent this long is gone (it publishes its facts every 5 s)

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Claim:
    """What one party asks of the window: its weight and how many chunks it could use."""

    weight: float
    demand: int


def allocate(window: int, claims: Mapping[K, Claim]) -> dict[K, int]:
    """Split `window` chunks between `claims`, weighted and max-min fair (water-filling): a
    party asking less than its share gets what it asks and the rest is split again among the
    others. Every party with demand gets at least one chunk, so none starves on a small window;
    the result's sum may then pass the window by that rounding."""
    caps: dict[K, int] = {}
    open_claims = {k: c for k, c in claims.items() if c.demand > 0}
    left = float(max(window, 0))
    while open_claims:
        total = sum(_weight(c) for c in open_claims.values())
        share = {k: left * _weight(c) / total for k, c in open_claims.items()}
        satisfied = [k for k, c in open_claims.items() if c.demand <= share[k]]
        if not satisfied:
            caps.update({k: max(1, math.floor(share[k] + 1e-9)) for k in open_claims})
            break
        for k in satisfied:
            caps[k] = open_claims.pop(k).demand
            left -= caps[k]
    return caps


def _weight(claim: Claim) -> float:
    return claim.weight if claim.weight > 0 else 1.0  # a weight left unset or nonsense: equal


def plan(window: int, jobs: list[db.BulkJob]) -> dict[str, int]:
    """Each job's cap of chunks in flight: the tenants' shares of the window, each split over
    its jobs. Jobs with nothing left to send get none (their chunks in flight still count)."""
    by_tenant: dict[str, list[db.BulkJob]] = {}
    for job in jobs:
        by_tenant.setdefault(job.tenant, []).append(job)
    tenants = allocate(
        window,
        {
            tenant: Claim(group[0].weight, sum(j.in_flight + j.unsent for j in group))
            for tenant, group in by_tenant.items()
        },
    )
    caps: dict[str, int] = {}
    for tenant, group in by_tenant.items():
        split = allocate(
            tenants.get(tenant, 0), {j.job_id: Claim(1.0, j.in_flight + j.unsent) for j in group}
        )
        caps.update({j.job_id: split.get(j.job_id, 0) for j in group if j.unsent > 0})
    return caps


def window_of(settings: Settings, workers: int) -> int:
    """The fleet-wide window: chunks per task thread × threads × live workers (one worker's
    worth when none has published yet: `kiln run`, a worker just starting)."""
    return max(1, settings.fair_share_window_per_slot * settings.task_threads * max(1, workers))


def top_up(sessions: Callable[[], Session], dispatcher: Dispatcher, settings: Settings) -> int:
    """Send every open bulk job's chunks up to its cap; returns how many chunks were sent."""
    with sessions() as session:
        jobs = db.open_bulk_jobs(session)
        if not any(j.unsent for j in jobs):
            return 0
        caps = (
            plan(window_of(settings, db.live_workers(session, LIVE_FOR_S)), jobs)
            if settings.fair_share
            else {j.job_id: j.in_flight + j.unsent for j in jobs}  # no cap: all at once
        )
        sent = 0
        for job in jobs:
            cap = caps.get(job.job_id, 0)
            if cap > job.in_flight:
                sent += send_up_to(session, dispatcher, job.job_id, cap)
    return sent


def send_up_to(session: Session, dispatcher: Dispatcher, job_id: str, cap: int) -> int:
    """One unit of work: the job's next unsent chunks while it has fewer than `cap` in flight,
    sent and recorded sent. Returns how many were sent."""
    with unit_of_work(session):
        sendable = db.lock_sendable(session, job_id, cap)
        if sendable is None:
            return 0
        for chunk, ids in sorted(sendable.chunks.items()):
            dispatcher.enqueue_chunk(job_id, chunk, ids, sendable.queue)
            leases.mark_sent(session, ids)
        db.mark_sent_through(session, job_id, sendable.sent_through)
    return len(sendable.chunks)


def top_up_quietly(
    sessions: Callable[[], Session], dispatcher: Dispatcher, settings: Settings
) -> int:
    """`top_up` for a path whose own work is done (a chunk's results are written): a failure is
    logged, not raised — the next chunk, the ingest or the reconciler tops up instead."""
    try:
        return top_up(sessions, dispatcher, settings)
    except Exception:  # a missed top-up only delays: the chunk stays done
        log.warning("fair share: top-up failed; the next one sends", exc_info=True)
        return 0
