"""The retention sweep, run with the reconciler on every `kiln beat` tick: it gives closed jobs
their expiry, then deletes what expired jobs own — their results (shards, manifest, groups,
index: the job's whole results folder, in Kiln's store or the user's `output`), their
uploads, then their item rows a short batch at a time — and keeps a one-row summary on the job.

Bounded per tick (KILN_RETENTION_SWEEP_ROWS item rows, OBJECTS_PER_TICK objects) and
resumable: each step is its own short transaction, a job is marked `expired_at` only once all
of it is gone, and the next tick carries on where this one stopped. Its deletes take row locks
on the expired job's own rows only, which no worker holds, so a chunk's write never waits.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.core.errors import OutputError
from kiln.app.db import queries
from kiln.app.db import retention as db
from kiln.app.db.models import Job, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.jobs import retention
from kiln.app.results.results import Place, manifest_key
from kiln.app.storage import ObjectStore

log = logging.getLogger(__name__)

JOBS_PER_TICK = 20
OBJECTS_PER_TICK = 2_000
MAX_PAUSE_S = 0.1  # the longest breath between two batches of item deletes


class Sweeping(Protocol):
    """What the sweep uses of a worker's runtime (`WorkerRuntime` is one; benches make theirs)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def sessions(self) -> sessionmaker[Session]: ...
    @property
    def store(self) -> ObjectStore: ...
    def place(self, job_id: str, output: str | None) -> Place: ...


@dataclass
class Budget:
    rows: int
    objects: int = OBJECTS_PER_TICK

    @property
    def spent(self) -> bool:
        return self.rows <= 0 or self.objects <= 0


def sweep(runtime: Sweeping, now: datetime | None = None) -> dict[str, int]:
    """One tick's worth: expiries given, then expired jobs swept within the budget."""
    now = now or utcnow()
    settings = runtime.settings
    with runtime.sessions() as session, unit_of_work(session):
        due = db.unstamped(session, settings.retention)
        db.stamp(session, due)
    with runtime.sessions() as session:
        expired = db.expired(session, now, JOBS_PER_TICK)
        session.expunge_all()
    budget = Budget(settings.retention_sweep_rows)
    rows = objects = swept = 0
    for job in expired:
        if budget.spent:
            break
        before = (budget.rows, budget.objects)
        try:
            swept += sweep_job(runtime, job, budget, now)
        except Exception as error:  # a store or bucket that refuses: the next tick tries again
            log.warning("retention: could not sweep job %s yet: %s", job.id, error)
        rows += before[0] - budget.rows
        objects += before[1] - budget.objects
    if swept or rows or objects:
        log.info("retention: %d jobs expired, %d item rows and %d objects deleted", swept, rows,
                 objects)  # fmt: skip
    return {
        "expiries_set": len(due),
        "jobs_expired": swept,
        "expired_rows": rows,
        "expired_objects": objects,
    }


def sweep_job(runtime: Sweeping, job: Job, budget: Budget, now: datetime) -> bool:
    """Summary first (its counts, read before the counters go), then objects, then items in
    batches; True once the job is wholly swept and marked."""
    place = runtime.place(job.id, job.output)
    if job.summary is None:
        with runtime.sessions() as session, unit_of_work(session):
            counts = queries.job_counts(session, job.id, bulk=job.source is not None)
            folder = place.store.describe(manifest_key(place)).removesuffix("manifest.json")
            summary = retention.summary_of(job, counts, folder)
            row = session.get(Job, job.id)
            assert row is not None
            row.summary = summary
    try:
        if not _delete_objects(place.store, place.prefix, budget):
            return False
    except OutputError as error:  # the user's output bucket is gone or refuses Kiln: nothing
        _results_left(runtime, job.id, str(error))  # of the job is left there to delete
    if not _delete_objects(runtime.store, f"jobs/{job.id}/", budget):  # its uploads
        return False
    while True:
        if budget.rows <= 0:
            return False  # the budget ran out first: more items, perhaps
        limit = min(db.ITEMS_PER_BATCH, budget.rows)
        started = time.perf_counter()
        with runtime.sessions() as session, unit_of_work(session):
            gone = db.delete_items(session, job.id, limit)
        budget.rows -= gone
        # As long again to breathe: the deletes' writes (WAL, I/O, a core) are not taken from
        # the workers' chunk writes back to back, on a busy host most of all.
        time.sleep(min(MAX_PAUSE_S, time.perf_counter() - started))
        if gone < limit:
            break
    with runtime.sessions() as session, unit_of_work(session):
        if db.has_items(session, job.id):  # one was skipped as locked: the next tick
            return False
        db.delete_job_state(session, job.id)
        db.mark_expired(session, job.id, now)
    return True


def _results_left(runtime: Sweeping, job_id: str, why: str) -> None:
    """Say in the job's summary why its results under the user's output were not deleted."""
    log.warning("retention: job %s's results stay where they are: %s", job_id, why)
    with runtime.sessions() as session, unit_of_work(session):
        row = session.get(Job, job_id)
        if row is not None:
            row.summary = {**(row.summary or {}), "results_left": why}


def _delete_objects(store: ObjectStore, prefix: str, budget: Budget) -> bool:
    """Delete objects under `prefix` within the budget; True once none is left."""
    allowed = budget.objects
    keys = list(itertools.islice(store.list(prefix), allowed + 1))  # listed, then deleted
    for key in keys[:allowed]:
        store.delete(key)
    budget.objects -= min(len(keys), allowed)
    return len(keys) <= allowed
