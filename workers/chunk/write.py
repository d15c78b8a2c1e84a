"""Write a chunk run's results: its Parquet shard, then its rows in the database.

The shard is written before the results commit, so whoever sees an item finished can read
it; a shard always holds each of its chunk's items once, in id order (a replay's, a cancel's
and a run's before a crash joined). Every write is idempotent, so a redelivered chunk is
harmless. Only the run that still holds the lease writes.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from kiln.app.db import chunk_results
from kiln.app.db.models import Item
from kiln.app.db.session import unit_of_work
from kiln.app.results import results
from kiln.workers.chunk.content_cache import fresh_entries
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.close.lease import Lease
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def write_chunk(
    runtime: WorkerRuntime,
    lease: Lease,
    rows: ChunkRows,
    fields: list[pa.Field],
    stages: bool = False,
) -> bool | None:
    """The shard, then the results in one unit (and what this run computed into the content
    cache, when it is on). `stages`: keep each item's milliseconds per stage (interactive
    chunks). Whether a shard was written; None when another run took the lease over (nothing
    written)."""
    settings = runtime.settings
    mine = {item.id: item.key for item in rows.items}
    whole = len(rows) == len(lease.item_ids)  # every item of the chunk is among this run's rows
    with runtime.sessions() as session:
        with unit_of_work(session):  # reads only
            earlier = chunk_results.earlier_results(
                session, lease.job_id, lease.chunk, lease.owner, mine, whole
            )
        if earlier is None:
            log.warning("chunk %s/%d: lease taken over; not writing", lease.job_id, lease.chunk)
            return None
        shard = _shard(rows, fields, earlier)
        if shard.num_rows:
            results.write_table(lease.place, lease.chunk, shard)
        cache = fresh_entries(settings, lease.tenant, rows) if settings.content_cache else {}
        done = chunk_results.ChunkResults(
            lease.job_id, lease.chunk, lease.owner, rows.document(stages), cache,
            settings.content_cache_ttl_s, lease.pipeline_id, lease.model.ref,
            rows.input_failures() if lease.pipeline_id is not None else (),
        )  # fmt: skip
        with unit_of_work(session):
            chunk_results.record(session, done)
    return bool(shard.num_rows)


def _shard(rows: ChunkRows, fields: list[pa.Field], earlier: list[Item]) -> pa.Table:
    """This run's rows (its items, less the videos that became frames), plus the chunk's items
    finished earlier (a replay, a cancel, a run before a crash), in id order."""
    table = rows.table(fields)
    if not earlier:
        return table
    ids = [item.id for item in rows.items] + [item.id for item in earlier]
    merged = pa.concat_tables([table, results.items_table(earlier, fields)])
    return merged.take(pa.array(np.argsort(ids, kind="stable")))
