"""One chunk run's report (`ChunkReport`) and its item counts; the process's running totals
over every chunk are `workers/ops/chunk_stats.py`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.workers.ops.chunk_stats import STAGES

if TYPE_CHECKING:
    from kiln.workers.chunk.rows import ChunkRows


@dataclass
class ChunkReport:
    """What one chunk run did (`process_chunk` returns it; the task logs it)."""

    job_id: str
    chunk: int
    processed: int = 0
    succeeded: int = 0
    failed: int = 0
    cached: int = 0  # answered from the content cache
    fell_back: int = 0  # taken by the job's fallback model (answered or failed again)
    # fetch and decode (CPU seconds of the prep processes, summed over items), infer (the
    # chunk's wall time in the model), write (shard, results, close)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    job_status: str | None = None


def count(rows: ChunkRows, report: ChunkReport) -> None:
    """The report's item counts from the rows' statuses (cancelled rows are not processed)."""
    statuses = Counter(rows.statuses())
    report.processed = len(rows) - statuses["cancelled"]
    report.failed = statuses["failed"]
    report.succeeded = report.processed - report.failed
