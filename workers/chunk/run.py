"""One chunk of a job, start to end: lease → answer (prep → batch → engine) → expand → write →
close.

A plain function of a `WorkerRuntime`: the Celery task is a thin adapter over it, and tests
call it without a broker. Each stage is a call into the room that does it, in the order it
runs, handed what it needs:

- `lease.take`: the chunk's items and what the run needs of its job (the `Lease`);
- `infer.answer_chunk`: every row through the job's model, then its fallback (`ChunkRows`);
- `expand.expand_videos`: a video's row becomes its frames, new items in chunks of their own;
- `write.write_chunk`: the shard, then the results in one statement;
- `close.close_after_chunk`: the job's close, if this chunk committed its last open item.
- a bulk chunk's end tops up the bulk queue's fair share (`app/jobs/fair_share.py`).

The process's lease keeper holds the lease meanwhile; a cancel or a lost lease stops the run
(`Held`). Every write is idempotent, so a redelivered chunk is harmless. A write the job's
output refuses for good (`OutputError`: its bucket missing or refusing Kiln) fails the whole
job at once (`close.fail.fail_for_output`): no retry, and no chunk of it runs inference again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter

from kiln.app.core.errors import OutputError
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.observability.tracing import annotate
from kiln.workers.chunk import lease as leasing
from kiln.workers.chunk.expand import expand_videos
from kiln.workers.chunk.infer import answer_chunk
from kiln.workers.chunk.stats import ChunkReport, count
from kiln.workers.chunk.write import write_chunk
from kiln.workers.close.close import close_after_chunk
from kiln.workers.close.fail import fail_for_output
from kiln.workers.close.fallback import shard_fields
from kiln.workers.close.lease import Lease
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def process_chunk(
    runtime: WorkerRuntime,
    job_id: str,
    chunk: int,
    item_ids: list[int],
    urgent: bool = False,
    owner: str | None = None,
    dispatcher: Dispatcher | None = None,
) -> ChunkReport:
    """`urgent`: an interactive chunk, whose rows go ahead of bulk rows in the Batcher.
    `owner`: this run's lease token (new per run, so a redelivered copy of a message that is
    still running elsewhere finds the items held and drops out). `dispatcher`: sends the
    chunks of a video's frames (without one, the reconciler sends them)."""
    report = ChunkReport(job_id, chunk)
    owner = owner or str(uuid.uuid4())
    where = {"job_id": job_id, "chunk": chunk, "items": len(item_ids)}  # for log lines
    lease = leasing.take(runtime, job_id, chunk, item_ids, owner)
    if lease is None:
        log.warning("chunk %s/%d: job no longer exists; dropping", job_id, chunk, extra=where)
        return report
    annotate(model=lease.model.ref, leased=len(lease.items))
    if lease.held_elsewhere:
        log.info("chunk %s/%d: another run holds it; dropping this copy", job_id, chunk,
                 extra=where)  # fmt: skip
        return report
    if lease.failed:  # its items ended with the job; its output may be what failed
        log.info("chunk %s/%d: the job has failed; dropping", job_id, chunk, extra=where)
        return report
    try:
        with runtime.leases.hold(job_id, owner, watched=bool(lease.items)) as held:
            if lease.cancelling:  # items a retry or the reconciler handed back: none runs
                held.stop(held.cancelled)
            rows = answer_chunk(runtime, lease, held, urgent, report)
            if not held.lost.is_set():
                rows = expand_videos(runtime, lease, rows, dispatcher)  # videos leave the rows
            count(rows, report)
            if held.lost.is_set():
                log.warning("chunk %s/%d: lease lost; another run owns the results", job_id,
                            chunk, extra=where)  # fmt: skip
                return report
            timer = time.monotonic()
            held.writing = True
            fields = shard_fields(lease.model, lease.fallback)
            try:
                wrote = write_chunk(runtime, lease, rows, fields, stages=urgent)
                if wrote is not None and wrote.ended:  # this chunk committed the job's last
                    report.job_status = close_after_chunk(
                        runtime.sessions, runtime.store, runtime.models, lease, wrote.shard, fields
                    )
            except OutputError as error:  # retrying cannot fix it: the job ends now
                report.job_status = fail_for_output(runtime, job_id, error)
            report.seconds["write"] = time.monotonic() - timer
            _top_up(runtime, lease, dispatcher)
    except BaseException as error:
        # so the task's retry can take the items at once, and they keep what stopped the run
        leasing.release(runtime, job_id, owner, error)
        raise
    statuses = Counter(str(status) for status in rows.statuses())  # for the worker's metrics
    runtime.chunk_stats.record(lease.model.ref, statuses, report.seconds, report.cached)
    return report


def _top_up(runtime: WorkerRuntime, lease: Lease, dispatcher: Dispatcher | None) -> None:
    """A bulk chunk's end frees its place in the fair share's window: the process's top-up
    thread sends the next chunks (app/jobs/fair_share.py, workers/ops/top_ups.py), so this
    thread goes on to its next chunk at once. Without a dispatcher the reconciler does."""
    if lease.bulk and dispatcher is not None:
        runtime.top_ups.request(dispatcher)
