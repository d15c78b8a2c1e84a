"""Write a chunk run's results: its Parquet shard, then its rows in the database.

The shard is written before the results commit, so whoever sees an item finished can read
it; a shard always holds each of its chunk's items once, in id order (a replay's, a cancel's
and a run's before a crash joined). Every write is idempotent, so a redelivered chunk is
harmless. Only the run that still holds the lease writes. After the commit, in a transaction
of its own, the run asks whether anything of the job is still open: whichever chunk commits
last sees every other chunk's results, so it is the one that finds nothing open, and closes
the job (`close/close.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kiln.app.db import chunk_results, queries
from kiln.app.db.models import Item
from kiln.app.db.session import unit_of_work
from kiln.app.results import results
from kiln.workers.chunk.content_cache import fresh_entries
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.close.lease import Lease
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Written:
    """What a chunk run's write did, and found."""

    shard: bool  # a shard was written (none: the chunk has no rows left, its videos became frames)
    ended: bool  # nothing of the job was open once its results committed: the run closes it


def write_chunk(
    runtime: WorkerRuntime,
    lease: Lease,
    rows: ChunkRows,
    fields: list[pa.Field],
    stages: bool = False,
) -> Written | None:
    """The shard, then the results in one unit (and what this run computed into the content
    cache, when it is on), then whether anything of the job is still open. `stages`: keep each
    item's milliseconds per stage (interactive chunks). None when another run took the lease
    over (nothing written)."""
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
        with unit_of_work(session):  # after the commit: every chunk committed before is seen
            ended = queries.nothing_open(session, lease.job_id)
    return Written(bool(shard.num_rows), ended)


def _shard(rows: ChunkRows, fields: list[pa.Field], earlier: list[Item]) -> pa.Table:
    """This run's rows (its items, less the videos that became frames), plus the chunk's items
    finished earlier (a replay, a cancel, a run before a crash), in id order."""
    table = rows.table(fields)
    if not earlier:
        return table
    ids = [item.id for item in rows.items] + [item.id for item in earlier]
    merged = pa.concat_tables([table, results.items_table(earlier, fields)])
    return merged.take(pa.array(np.argsort(ids, kind="stable")))
