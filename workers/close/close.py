"""Close a job once none of its items is open: its missing shards first, its close steps,
then its status (one conditional update), then its manifest.

Closing is its own unit, after a chunk's results commit, and takes no lock shared by the job's
chunks: whichever chunk commits last sees every other chunk's results, so it closes the job
(two seeing it at once race on one conditional update, and one wins). A chunk that saw items
still open leaves the close to whichever commits after it. A job closes only once every chunk
has a shard, so whoever sees `completed` can read every row; a replay after a crash finishes
what was left undone. The reconciler closes a job whose last chunk stopped in between.
"""

from __future__ import annotations

import pyarrow as pa
from sqlalchemy.orm import Session

from kiln.app import results
from kiln.app.core.errors import OutputError
from kiln.app.db import leases, queries
from kiln.app.db.session import unit_of_work
from kiln.workers.close.fail import fail_for_output
from kiln.workers.close.fallback import job_fallback, shard_fields
from kiln.workers.close.lease import Lease
from kiln.workers.close.manifest import ensure_manifest
from kiln.workers.close.steps import close_steps
from kiln.workers.runtime import WorkerRuntime


def close_after_chunk(
    runtime: WorkerRuntime, lease: Lease, wrote: bool, fields: list[pa.Field]
) -> str | None:
    """After a chunk's results commit: once nothing of the job is left open, its missing
    shards, its close steps, its status, its manifest (`wrote`: this chunk wrote a shard).
    A replay of a closed job heals its shards and manifest. Returns the final status if this
    call closed the job."""
    with runtime.sessions() as session:
        with unit_of_work(session):  # reads, and shards only a crash left unwritten
            shards = _shards_once_done(session, lease, wrote, fields)
        if shards is None:
            return None  # items still open: whichever chunk commits last closes the job
        final, steps = None, None
        if lease.was_open:
            job = queries.job_as_now(session, lease.job_id)
            if job is not None:  # before the status closes: whoever sees it closed finds them
                steps = close_steps(runtime.store, session, job, lease.model, lease.place)
            with unit_of_work(session):
                final = queries.finish_job_if_done(session, lease.job_id)
            if final is None:
                return None  # another chunk closed it, and writes the manifest
        closed_now = final is not None
        ensure_manifest(runtime, session, lease.job_id, lease.model, closed_now, shards, steps)
    return final


def _shards_once_done(
    session: Session, lease: Lease, wrote: bool, fields: list[pa.Field]
) -> list[str] | None:
    """None while any item of the job is open (or its source is still listed); else every
    shard key, after writing those a crash left unwritten."""
    if not queries.nothing_open(session, lease.job_id):
        return None
    shards = write_missing_shards(session, lease.place, lease.job_id, fields)
    if lease.chunk_count <= 1 and not lease.bulk:  # one chunk: its own shard, if it wrote one
        return [results.shard_key(lease.place, lease.chunk)] if wrote else []
    return shards


def close_if_done(
    session: Session, place: results.Place, job_id: str, fields: list[pa.Field]
) -> tuple[str | None, list[str] | None]:
    """Close a job of many chunks once none has open items: its missing shards first, so a
    closed job always has every shard. The final status and the shard keys, or (None, None)."""
    if not queries.nothing_open(session, job_id):
        return None, None
    shards = write_missing_shards(session, place, job_id, fields)
    return queries.finish_job_if_done(session, job_id), shards


def close_finished_job(runtime: WorkerRuntime, job_id: str) -> str | None:
    """The reconciler's close of an open job whose items have all ended (its last chunk's run
    stopped between committing its results and closing the job); returns the final status if
    this call closed it. An output that refuses its shards fails the job instead."""
    try:
        return _close_finished_job(runtime, job_id)
    except OutputError as error:
        return fail_for_output(runtime, job_id, error)


def _close_finished_job(runtime: WorkerRuntime, job_id: str) -> str | None:
    with runtime.sessions() as session:
        job = leases.job_facts(session, job_id)
        if job is None:
            return None
        model = runtime.model_info(session, job.model, job.tenant)
        fields = shard_fields(model, job_fallback(runtime, session, job.tenant, job.options))
        with unit_of_work(session):
            final, shards = close_if_done(
                session, runtime.place(job_id, job.output), job_id, fields
            )
        if final is not None:
            ensure_manifest(runtime, session, job_id, model, True, shards)
    return final


def write_missing_shards(
    session: Session, place: results.Place, job_id: str, fields: list[pa.Field]
) -> list[str]:
    """Chunks whose results are in the database but whose shard is not in storage (a crash
    between the two, a job cancelled before its chunks ran); returns every shard key."""
    written = set(results.shard_keys(place))
    for chunk in queries.job_chunks(session, job_id):
        key = results.shard_key(place, chunk)
        if key not in written:
            items = queries.chunk_items(session, job_id, chunk)
            results.write_shard(place, chunk, items, fields)
            written.add(key)
    return sorted(written)
