"""Finish a chunk: its Parquet shard, its results in the database, and — for the chunk that
finds nothing left open — the job's close and manifest.

The shard is written before the results commit, and a job closes only once every chunk has
a shard, so whoever sees `completed` can read every row. A replay after a crash finishes what
was left undone; all writes are idempotent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy.orm import Session

from kiln.app import results
from kiln.app.catalog import ModelInfo
from kiln.app.db import chunk_runs, ingest, leases, queries
from kiln.app.db import content_cache as cache_rows
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import ItemStatus, Job, aware
from kiln.app.db.session import unit_of_work
from kiln.app.families.fallback import FallbackOptions
from kiln.app.video import Sampling
from kiln.workers.chunk.content_cache import fresh_entries
from kiln.workers.chunk.fallback import Fallback, job_fallback, shard_fields
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.close import identical
from kiln.workers.close.library import library_place
from kiln.workers.close.library import update as update_library
from kiln.workers.models.base import ClosedJob
from kiln.workers.models.loader import job_closed, library_columns
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """What a chunk learned when it took its items."""

    job_id: str
    chunk: int
    item_ids: list[int]
    chunk_count: int
    was_open: bool  # the job was open when leased (else this is a replay of a closed job)
    model: ModelInfo
    items: list[LeasedItem]
    place: results.Place  # where the job's results go
    bulk: bool = False  # items come from an ingest (the chunk count grows while it lists)
    pipeline_id: int | None = None  # bulk, incremental: remember what succeeded
    owner: str = ""  # the run holding the items' lease: only its results are written
    held_elsewhere: bool = False  # nothing leased because another live run holds the chunk
    tenant: str = ""
    fallback: Fallback | None = None  # the job's fallback model, if it names one
    sampling: Sampling | None = None  # how the job samples its videos
    cancelling: bool = False  # the job was cancelled: what this run took, it cancels


def finish_chunk(
    runtime: WorkerRuntime, lease: Lease, rows: ChunkRows, stages: bool = False
) -> str | None:
    """Write the shard, the results in one statement (and what this run computed into the
    content cache, when it is on); close the job if nothing is open. `stages`: keep each
    item's milliseconds per stage (interactive chunks). Returns the final status if this call
    closed the job."""
    fields = shard_fields(lease.model, lease.fallback)
    settings = runtime.settings
    with runtime.sessions() as session:
        with unit_of_work(session):  # reads only
            if lease.items and not leases.holds(session, lease.job_id, lease.owner):
                log.warning("chunk %s/%d: lease taken over; not writing", lease.job_id, lease.chunk)
                return None
            shard = _shard(session, lease, rows, fields)
        if shard.num_rows:  # before the results commit: whoever sees an item finished can read it
            results.write_table(lease.place, lease.chunk, shard)
        with unit_of_work(session):
            document = rows.document(stages)
            queries.upsert_results(session, lease.job_id, lease.chunk, document, lease.owner)
            chunk_runs.forget(session, [lease.owner])  # its progress is in the counters now
            if settings.content_cache:
                fresh = fresh_entries(settings, lease.tenant, rows.pieces, rows.sha256)
                for scope, entries in fresh.items():
                    cache_rows.cache_results(session, scope, entries, settings.content_cache_ttl_s)
            if lease.pipeline_id is not None:
                done = [row[0] for row in document if row[1] == ItemStatus.SUCCEEDED]
                ingest.mark_done(session, lease.pipeline_id, lease.job_id, lease.model.ref, done)
        closing, steps = True, None
        if lease.was_open:
            closing, steps = _steps_before_close(runtime, session, lease, fields)
        # Closing is its own unit, after the results commit, and takes no lock shared by the
        # job's chunks: whichever chunk commits last sees every other chunk's results, so it
        # closes the job (two seeing it at once race on one conditional update, and one wins).
        # A chunk that saw items still open leaves the close to whichever commits after it.
        final, shards = None, None
        if closing:
            with unit_of_work(session):
                final, shards = _close_if_done(session, lease, bool(shard.num_rows), fields)
        if final is not None or not lease.was_open:
            closed_now = final is not None
            ensure_manifest(runtime, session, lease.job_id, lease.model, closed_now, shards, steps)
        runtime.chunk_done(lease.job_id)
    return final


def _steps_before_close(
    runtime: WorkerRuntime, session: Session, lease: Lease, fields: list[pa.Field]
) -> tuple[bool, dict[str, Any] | None]:
    """Whether nothing is left open, and then the close steps (groups, vector index, library):
    run before the job's status closes, so whoever sees it closed finds its groups and index.
    Two chunks finishing at once may both run them; they write the same objects."""
    with unit_of_work(session):  # reads, and shards only a crash left unwritten
        if queries.has_open_items(session, lease.job_id) or ingest.listing(session, lease.job_id):
            return False, None
        write_missing_shards(session, lease.place, lease.job_id, fields)
        job = session.get(Job, lease.job_id, populate_existing=True)
    if job is None:
        return True, None
    return True, _close_steps(runtime, session, job, lease.model, lease.place)


def _shard(session: Session, lease: Lease, rows: ChunkRows, fields: list[pa.Field]) -> pa.Table:
    """This run's rows, plus the chunk's items finished earlier (a replay, a cancel, a run
    before a crash): a shard always holds each of its chunk's items once, in id order."""
    table = rows.table(fields)
    if len(rows) == len(lease.item_ids):
        return table
    mine = {item.key for item in lease.items}
    chunk = queries.finished_chunk_items(session, lease.job_id, lease.chunk)
    earlier = [item for item in chunk if item.key not in mine]
    if not earlier:
        return table
    ids = [item.id for item in lease.items] + [item.id for item in earlier]
    merged = pa.concat_tables([table, results.items_table(earlier, fields)])
    return merged.take(pa.array(np.argsort(ids, kind="stable")))


def _close_if_done(
    session: Session, lease: Lease, wrote: bool, fields: list[pa.Field]
) -> tuple[str | None, list[str] | None]:
    """Close the job if no item is open: the final status and the shard keys (if known)."""
    if lease.chunk_count <= 1 and not lease.bulk:  # a bulk job may gain chunks as it lists
        shards = [results.shard_key(lease.place, lease.chunk)] if wrote else []
        return queries.finish_job_if_done(session, lease.job_id), shards
    return close_if_done(session, lease.place, lease.job_id, fields)


def close_if_done(
    session: Session, place: results.Place, job_id: str, fields: list[pa.Field]
) -> tuple[str | None, list[str] | None]:
    """Close a job of many chunks once none has open items: its missing shards first, so a
    closed job always has every shard. The final status and the shard keys, or (None, None)."""
    if queries.has_open_items(session, job_id) or ingest.listing(session, job_id):
        return None, None
    shards = write_missing_shards(session, place, job_id, fields)
    return queries.finish_job_if_done(session, job_id), shards


def close_finished_job(runtime: WorkerRuntime, job_id: str) -> str | None:
    """The reconciler's close of an open job whose items have all ended (its last chunk's run
    stopped between committing its results and closing the job); returns the final status if
    this call closed it."""
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


def ensure_manifest(
    runtime: WorkerRuntime,
    session: Session,
    job_id: str,
    model: ModelInfo,
    closed_now: bool,
    shards: list[str] | None,
    steps: dict[str, Any] | None = None,
) -> None:
    """The closed job's manifest: written by whoever closed it, or healed by a later replay.
    `steps`: what the close steps added, when they ran before the close (else they run now)."""
    # Fresh from the database: the caller's session may hold the job as it was before it closed
    # (the ingest's close of a rerun with nothing to process).
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or queries.is_open(job):
        return
    place = runtime.place(job.id, job.output)
    if not closed_now and place.store.exists(results.manifest_key(place)):
        return
    counts = queries.job_counts(session, job_id)
    runner = runtime.runners().get(model.cache_key)
    manifest = {
        "job_id": job.id,
        "model": job.model,
        "status": job.status,
        "engine": runner.pipeline.backend if runner else None,
        "counts": {
            "total": counts.total,
            "succeeded": counts.succeeded,
            "failed": counts.failed,
            "cancelled": counts.cancelled,
            "skipped": counts.skipped,
            "deleted": counts.deleted,
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
    manifest |= steps if steps is not None else _close_steps(runtime, session, job, model, place)
    results.write_manifest(place, manifest, shards)
    log.info("job %s %s: %s", job.id, job.status, counts)


def _close_steps(
    runtime: WorkerRuntime, session: Session, job: Job, model: ModelInfo, place: results.Place
) -> dict[str, Any]:
    """A pipeline run's library update, the family's job-closed step (its near-duplicate
    groups), then byte-identical inputs joined into them, for every model — over the whole
    library for a pipeline run; what they add to the manifest."""
    library = None
    if job.pipeline_id is not None:
        where = library_place(runtime.store, job.pipeline_id, model.ref)
        library = update_library(where, place, library_columns(model))
    summary: dict[str, Any] = {}
    if (step := job_closed(model)) is not None:
        outputs = partial(queries.item_outputs, session, job.id)
        summary = step(ClosedJob(job, outputs, place, library))
    same = library.identical() if library else queries.identical_inputs(session, job.id)
    summary = identical.close_job(place, same, summary)
    return summary | ({"library": library.summary()} if library else {})


def _seconds(job: Job) -> float | None:
    started, finished = aware(job.started_at), aware(job.finished_at)
    return round((finished - started).total_seconds(), 3) if started and finished else None


def _iso(value: datetime | None) -> str | None:
    stamp = aware(value)
    return stamp.isoformat() if stamp else None
