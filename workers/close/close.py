"""Close a job once none of its items is open: its shards listed, one read (the job, its
counts, its chunks and the items of any chunk without a shard), the missing shards, its close
steps, then one write (the conditional update that closes it and tells the API), then its
manifest.

Closing is its own unit, after a chunk's results commit, and takes no lock shared by the job's
chunks: whichever chunk commits last sees every other chunk's results (`write.write_chunk`
asks, after its commit), so it closes the job (two seeing it at once race on one conditional
update, and one wins). A chunk that saw items still open leaves the close to whichever commits
after it. A job closes only once every chunk has a shard and its close steps have run, so
whoever sees it closed can read every row and what the steps wrote; a replay after a crash
finishes what was left undone. The reconciler closes a job whose last chunk stopped in
between, the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ClosingJob:
    """The job a close is about: what the close is handed of it (the rest it reads)."""

    job_id: str
    was_open: bool  # open when the caller's run began (else a replay: it heals what is missing)
    model: ModelInfo
    place: results.Place
    fields: list[pa.Field]  # the shards' columns: the model's, then its fallback's
    engine: str | None  # the backend the model runs on in this process, for the manifest


def close_after_chunk(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    models: ModelRunners,
    lease: Lease,
    wrote: bool,
    fields: list[pa.Field],
) -> str | None:
    """After a chunk's results commit and nothing of the job is left open: close it (`wrote`:
    this chunk wrote a shard; `store`: Kiln's own, for a pipeline's library). A replay of a
    closed job heals its shards and manifest. Returns the final status if this call closed
    the job."""
    own = None
    if lease.chunk_count <= 1 and not lease.bulk:  # one chunk: its own shard, if it wrote one
        own = [results.shard_key(lease.place, lease.chunk)] if wrote else []
    engine = _engine(models, lease.model)
    job = ClosingJob(lease.job_id, lease.was_open, lease.model, lease.place, fields, engine)
    with sessions() as session:
        return close_job(session, store, job, own)


def close_job(
    session: Session, store: ObjectStore, job: ClosingJob, own: list[str] | None = None
) -> str | None:
    """Close the job if nothing of it is open (`own`: its shard keys, where the caller knows
    them): its shards listed, the one read, the shards a crash or a cancel left unwritten, the
    close steps, the one write, the manifest. Called once nothing of the job is open, so every
    chunk whose results committed has its shard listed. A call for a closed job (a replay)
    writes a manifest it lacks. The final status if this call closed it."""
    place = job.place
    shards = results.shards_by_chunk(place)  # first: the read brings the items of the rest
    with unit_of_work(session):  # the one read, and the shards no run of theirs wrote
        found = queries.closing(session, job.job_id, shards.keys())
        if found is None:
            return None  # items still open: whichever chunk commits last closes the job
        healing = not job.was_open and not place.store.exists(results.manifest_key(place))
        for chunk, items in found.unwritten.items():
            shards[chunk] = results.write_shard(place, chunk, items, job.fields)
    closes = job.was_open and queries.is_open(found.job)
    if not (closes or (healing and not queries.is_open(found.job))):
        return None  # another call closed it, and writes the manifest; or nothing to heal
    # before the status closes: whoever sees it closed finds what they wrote
    steps = close_steps(store, session, found.job, job.model, place)
    finished = None
    if closes:
        with unit_of_work(session):
            finished = queries.finish_job_if_done(session, job.job_id)
        if finished is None:
            return None  # another chunk closed it, and writes the manifest
    gone = results.deleted_key(place)
    deleted = gone if found.counts.deleted and place.store.exists(gone) else None
    manifest = manifest_of(found, finished, job.engine, steps, deleted)
    results.write_manifest(place, manifest, own if own is not None else sorted(shards.values()))
    log.info("job %s %s: %s", job.job_id, manifest["status"], found.counts)
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
    engine = _engine(runtime.models, model)
    return close_job(
        session, runtime.store, ClosingJob(job.id, was_open, model, place, fields, engine)
    )


def _engine(models: ModelRunners, model: ModelInfo) -> str | None:
    """The backend `model` runs on in this process (None: not loaded here)."""
    runner = models.runners().get(model.cache_key)
    return runner.predictor.backend if runner else None
