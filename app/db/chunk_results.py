"""What a chunk run writes when it is done, in the caller's one unit of work: its rows'
results (one statement, only for the items its lease still holds), the end of its progress
row, the content-cache entries it computed and, for an incremental pipeline, the objects it
finished (succeeded, or failed for their input's sake: known failures); and what it reads
first, for its shard (`earlier_results`). Never commits: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from kiln.app.db import chunk_runs, content_cache, ingest, leases, queries
from kiln.app.db.content_cache import Entry
from kiln.app.db.models import Item, ItemStatus


@dataclass(frozen=True)
class ChunkResults:
    job_id: str
    chunk: int
    owner: str  # the run's lease: rows of items another run took over are not written
    rows: Sequence[Sequence[Any]]  # one per item: key, status, … (`queries.RESULT_COLUMNS`)
    cache: Mapping[str, Mapping[str, Entry]] = field(default_factory=dict)  # scope, sha256
    cache_ttl_s: float = 0.0
    pipeline_id: int | None = None  # an incremental pipeline's run: remember what succeeded
    model: str = ""  # the job's model ref, with the pipeline's objects
    # Keys whose input failed (not a failure Kiln caused): a pipeline keeps them as known.
    input_failures: Sequence[str] = ()


def earlier_results(
    session: Session, job_id: str, chunk: int, owner: str, mine: Mapping[int, str], whole: bool
) -> list[Item] | None:
    """Before a run writes its chunk: None when it holds its items no longer (another run took
    the chunk over; a run with no rows of its own holds none, and is not asked). Else the
    chunk's items that finished outside the run (a replay's, a cancel's, a run's before a
    crash), keys not among `mine` (the run's items, id → key), in id order; none is read when
    the run's rows are the `whole` chunk."""
    if mine and not leases.holds_any(session, job_id, owner, list(mine)):
        return None
    if whole:
        return []
    keys = set(mine.values())
    finished = queries.finished_chunk_items(session, job_id, chunk)
    return [item for item in finished if item.key not in keys]


def record(session: Session, done: ChunkResults) -> None:
    queries.upsert_results(session, done.job_id, done.chunk, done.rows, done.owner)
    chunk_runs.forget(session, [done.owner])  # its progress is in the counters now
    for scope, entries in done.cache.items():
        content_cache.cache_results(session, scope, entries, done.cache_ttl_s)
    if done.pipeline_id is not None:
        keys = [row[0] for row in done.rows if row[1] == ItemStatus.SUCCEEDED]
        ingest.mark_done(session, done.pipeline_id, done.job_id, done.model, keys)
        failed = done.input_failures
        ingest.mark_failed(session, done.pipeline_id, done.job_id, done.model, failed)
