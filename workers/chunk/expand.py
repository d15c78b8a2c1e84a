"""A video item becomes its sampled frames: one item per frame, in chunks of their own.

When a chunk's prep finds that an item is a video (by its bytes), the item is *planned*, not
run: one unit of work takes the video item out (only while this run still leases it), adds a
pending item per sampled frame — keyed `<key>#t=<seconds>`, the video's source, its frame
index and time — in new chunks, and counts them; after the commit the new chunks are sent.
A crash before the commit leaves the video item to be planned again; after it, the frames are
ordinary pending items (the reconciler re-sends a chunk whose message was lost). So every
sampled moment ends as exactly one item, as every image does.

Frame chunks begin at keyframes where the video allows, so each chunk's first seek lands on
its first frame and no frame is decoded twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from kiln.app import video
from kiln.app.db import counters, ingest, items, queries
from kiln.app.db.items import NewItem
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import JobStatus
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import BULK, Dispatcher
from kiln.app.jobs import queue_for
from kiln.workers.chunk.lease import Lease
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.prep.video import FramePlan
from kiln.workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# A long video spreads over this many chunks per prep process of the worker that plans it: each
# process then decodes about two stretches at once, one reader each (more would interleave
# past its open readers, and every switch would decode a GOP again).
CHUNKS_PER_PROCESS = 2
MIN_FRAME_CHUNK = 32


def expand_videos(
    runtime: WorkerRuntime, lease: Lease, rows: ChunkRows, dispatcher: Dispatcher | None
) -> ChunkRows:
    """Replace the chunk's video rows by their frames (a unit of work, then the sends); the
    rows left are the chunk's other items, whose results are written as usual."""
    videos = [row for row, plan in enumerate(rows.videos) if plan is not None]
    if not videos:
        return rows
    sent: dict[int, list[int]] = {}
    queue = ""
    with runtime.sessions() as session:
        with unit_of_work(session):
            job = queries.lock_job(session, lease.job_id)  # job row first, as every writer does
            if job is None:
                return rows.without(videos)
            if job.status != JobStatus.RUNNING and job.status != JobStatus.QUEUED:
                rows.cancelled[videos] = True  # cancelling: the video ends as one item
                return rows
            ids = [rows.items[row].id for row in videos]
            taken = items.take_out_leased(session, lease.job_id, ids, lease.owner)
            planned = [
                (rows.items[row], rows.videos[row]) for row in videos if rows.items[row].id in taken
            ]
            count = sum(len(plan.times) for _, plan in planned)
            spread = CHUNKS_PER_PROCESS * max(1, runtime.prep().processes)
            size = frame_chunk_size(count, runtime.settings.bulk_chunk_size, spread)
            new, chunks = [], 0
            for item, plan in planned:
                frames, used = chunked(item, taken[item.id], plan, size, job.chunk_count + chunks)
                new += frames
                chunks += used
            sent = items.insert_items(session, job.id, new)
            job.chunk_count += chunks
            counters.add(
                session, job.id, counters.slot_of(lease.chunk), counters.Tally(total=-len(taken))
            )
            if lease.pipeline_id is not None:
                done = [(item.key, taken[item.id]) for item, _ in planned]
                ingest.mark_videos_done(session, lease.pipeline_id, lease.model.ref, done)
            if queue_for(count) == BULK:  # a long video: its chunks (and re-sends) go to bulk
                job.queue = BULK
            queue = job.queue
        log.info(
            "chunk %s/%d: %d video(s) → %d frame items in %d chunks", lease.job_id, lease.chunk,
            len(taken), sum(len(ids) for ids in sent.values()), len(sent),
            extra={"job_id": lease.job_id, "chunk": lease.chunk},
        )  # fmt: skip
    _send(dispatcher, lease.job_id, sent, queue)
    return rows.without(videos)


def frame_chunk_size(frames: int, most: int, spread: int) -> int:
    """Frames per chunk: a video spreads over `spread` chunks, each at most a bulk chunk and at
    least MIN_FRAME_CHUNK frames (fewer chunks amortise their writes)."""
    return max(1, min(most, max(MIN_FRAME_CHUNK, math.ceil(frames / max(1, spread)))))


def chunk_starts(gops: Sequence[int], size: int) -> list[int]:
    """Where a video's frames are cut into chunks of about `size`: at the first frame of a GOP
    once a chunk has `size` frames (so each chunk's seek lands on its own first frame), and at
    twice `size` whatever the GOP (a video of one long GOP still spreads)."""
    starts = [0] if gops else []
    for i in range(1, len(gops)):
        held = i - starts[-1]
        if (held >= size and gops[i] != gops[i - 1]) or held >= 2 * size:
            starts.append(i)
    return starts


def chunked(
    item: LeasedItem, etag: str | None, plan: FramePlan, size: int, first: int
) -> tuple[list[NewItem], int]:
    """One video's frame items, numbered into chunks from `first`; and how many chunks."""
    starts = chunk_starts(plan.gops, size)
    chunk_of = np.zeros(len(plan.times), dtype=np.int64)
    chunk_of[starts[1:]] = 1
    chunk_of = np.cumsum(chunk_of) + first
    items = [
        NewItem(
            video.frame_key(item.key, t),
            int(c),
            item.source,
            etag=etag,
            frame_index=i if i >= 0 else None,  # past a cut: no frame of the video
            frame_time_s=t,
        )
        for t, i, c in zip(plan.times, plan.indices, chunk_of.tolist(), strict=True)
    ]
    return items, len(starts)


def _send(
    dispatcher: Dispatcher | None, job_id: str, chunks: dict[int, list[int]], queue: str
) -> None:
    """After the commit: a chunk not sent (no dispatcher, a broker away) is re-sent by the
    reconciler, as any pending chunk is."""
    if dispatcher is None:
        return
    try:
        for chunk, ids in sorted(chunks.items()):
            dispatcher.enqueue_chunk(job_id, chunk, ids, queue)
    except Exception as error:
        log.warning("job %s: frame chunks not sent (%s); the reconciler will", job_id, error)
