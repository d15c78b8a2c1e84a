"""Close a job once none of its items is open: one read (the job, its counts, its chunks), its
missing shards, its close steps, then one write (the conditional update that closes it and
tells the API), then its manifest.

Closing is its own unit, after a chunk's results commit, and takes no lock shared by the job's
chunks: whichever chunk commits last sees every other chunk's results, so it closes the job
(two seeing it at once race on one conditional update, and one wins). A chunk that saw items
still open leaves the close to whichever commits after it. A job closes only once every chunk
has a shard and its close steps have run, so whoever sees it closed can read every row and
what the steps wrote; a replay after a crash finishes what was left undone. The reconciler
closes a job whose last chunk stopped in between, the same way.
"""

from __future__ import annotations

import logging

import pyarrow as pa
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.errors import OutputError
from kiln.app.db import leases, queries
from kiln.app.db.leases import JobFacts
from kiln.app.db.models import Job
from kiln.app.db.session import unit_of_work
from kiln.app.results import results
from kiln.app.storage import ObjectStore
from kiln.workers.close.fail import fail_for_output
from kiln.workers.close.fallback import job_fallback, shard_fields
from kiln.workers.close.lease import Lease
from kiln.workers.close.manifest import manifest_of
from kiln.workers.close.steps import close_steps
from kiln.workers.runners.runners import ModelRunners
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def close_after_chunk(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    models: ModelRunners,
    lease: Lease,
    wrote: bool,
    fields: list[pa.Field],
) -> str | None:
    """After a chunk's results commit: once nothing of the job is left open, close it
    (`wrote`: this chunk wrote a shard; `store`: Kiln's own, for a pipeline's library). A
    replay of a closed job heals its shards and manifest. Returns the final status if this
    call closed the job."""
    own = None
    if lease.chunk_count <= 1 and not lease.bulk:  # one chunk: its own shard, if it wrote one
        own = [results.shard_key(lease.place, lease.chunk)] if wrote else []
    with sessions() as session:
        return close_job(
            session, store, models, lease.place, lease.model, fields, lease.job_id,
            lease.was_open, own,
        )  # fmt: skip


def close_job(
    session: Session,
    store: ObjectStore,
    models: ModelRunners,
    place: results.Place,
    model: ModelInfo,
    fields: list[pa.Field],
    job_id: str,
    was_open: bool,
    own: list[str] | None = None,
) -> str | None:
    """Close the job if nothing of it is open (`was_open`: it was open when this call's run
    began; `own`: its shard keys, where the caller knows them): the one read, the shards a
    crash left unwritten, the close steps, the one write, the manifest. A call for a closed
    job (a replay) writes a manifest it lacks. The final status if this call closed it."""
    with unit_of_work(session):  # the one read, and the shards only a crash left unwritten
        found = queries.closing(session, job_id)
        if found is None:
            return None  # items still open: whichever chunk commits last closes the job
        shards = set(results.shard_keys(place))
        healing = not was_open and not place.store.exists(results.manifest_key(place))
        missing = [c for c in found.chunks if results.shard_key(place, c) not in shards]
        if missing:  # their items, in one read
            for chunk, items in queries.chunk_items(session, job_id, missing).items():
                shards.add(results.write_shard(place, chunk, items, fields))
    closes = was_open and queries.is_open(found.job)
    if not (closes or (healing and not queries.is_open(found.job))):
        return None  # another call closed it, and writes the manifest; or nothing to heal
    # before the status closes: whoever sees it closed finds what they wrote
    steps = close_steps(store, session, found.job, model, place)
    finished = None
    if closes:
        with unit_of_work(session):
            finished = queries.finish_job_if_done(session, job_id)
        if finished is None:
            return None  # another chunk closed it, and writes the manifest
    runner = models.runners().get(model.cache_key)
    engine = runner.predictor.backend if runner else None
    gone = results.deleted_key(place)
    deleted = gone if found.counts.deleted and place.store.exists(gone) else None
    manifest = manifest_of(found, finished, engine, steps, deleted)
    results.write_manifest(place, manifest, own if own is not None else sorted(shards))
    log.info("job %s %s: %s", job_id, manifest["status"], found.counts)
    return finished.status if finished else None


def close_closed_job(runtime: WorkerRuntime, session: Session, job: JobFacts | Job) -> None:
    """What follows a close another unit of work made (the ingest's, of a rerun with nothing
    left to process): its shards, close steps and manifest."""
    _close(runtime, session, job, was_open=False)


def close_finished_job(runtime: WorkerRuntime, job_id: str) -> str | None:
    """The reconciler's close of an open job whose items have all ended (its last chunk's run
    stopped between committing its results and closing the job); returns the final status if
    this call closed it. An output that refuses its shards fails the job instead."""
    try:
        with runtime.sessions() as session:
            job = leases.job_facts(session, job_id)
            return None if job is None else _close(runtime, session, job, was_open=True)
    except OutputError as error:
        return fail_for_output(runtime, job_id, error)


def _close(
    runtime: WorkerRuntime, session: Session, job: JobFacts | Job, was_open: bool
) -> str | None:
    model = runtime.model_info(session, job.model, job.tenant)
    fields = shard_fields(model, job_fallback(runtime, session, job.tenant, job.options))
    place = runtime.place(job.id, job.output)
    return close_job(session, runtime.store, runtime.models, place, model, fields, job.id, was_open)
