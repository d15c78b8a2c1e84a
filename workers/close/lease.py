"""What a chunk run learned when it took its items (`Lease`): taken by `workers/chunk/lease.py`,
read by every stage of the run and by the close that ends it, so it lives in the lowest room
that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db.leases import LeasedItem
from kiln.app.results import results
from kiln.app.video import Sampling
from kiln.workers.close.fallback import Fallback


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
    failed: bool = False  # the job failed: its items ended with it, nothing is left to write
