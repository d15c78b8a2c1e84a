"""A video item becomes its sampled frames: one item per frame, in chunks of their own.

When a chunk's prep finds that an item is a video (by its bytes), the item is *planned*, not
run: here its sampled frames are cut into chunks — each frame keyed `<key>#t=<seconds>`, with
the video's source, its frame index and time —, then one unit of work
(`app/db/frames.replace_videos`) takes the video item out (only while this run still leases
it), adds the frames as pending items in new chunks, and counts them; after the commit the new
chunks are sent.
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
from kiln.app.db import frames
from kiln.app.db.frames import NotExpanded
from kiln.app.db.items import NewItem
from kiln.app.db.leases import LeasedItem
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import BULK, Dispatcher
from kiln.app.jobs.jobs import queue_for
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.close.lease import Lease
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
    asked = _frames(runtime, lease, rows, videos)
    with runtime.sessions() as session, unit_of_work(session):
        done = frames.replace_videos(session, asked)
    if done is NotExpanded.JOB_GONE:
        return rows.without(videos)
    if done is NotExpanded.JOB_NOT_RUNNING:
        rows.cancelled[videos] = True  # cancelling: the video ends as one item
        return rows
    log.info(
        "chunk %s/%d: %d video(s) → %d frame items in %d chunks", lease.job_id, lease.chunk,
        done.videos, sum(len(ids) for ids in done.chunks.values()), len(done.chunks),
        extra={"job_id": lease.job_id, "chunk": lease.chunk},
    )  # fmt: skip
    _send(dispatcher, lease.job_id, done.chunks, done.queue)
    return rows.without(videos)


def _frames(
    runtime: WorkerRuntime, lease: Lease, rows: ChunkRows, videos: list[int]
) -> frames.ChunkVideos:
    """The frames of these video rows, cut into chunks spread over this worker's prep
    processes; many frames in all make the job a bulk one."""
    count = sum(len(rows.videos[row].times) for row in videos)
    spread = CHUNKS_PER_PROCESS * max(1, runtime.prep.processes)
    size = frame_chunk_size(count, runtime.settings.bulk_chunk_size, spread)
    planned = [chunked(rows.items[row], rows.videos[row], size) for row in videos]
    return frames.ChunkVideos(
        lease.job_id, lease.chunk, lease.owner, planned, long=queue_for(count) == BULK,
        pipeline_id=lease.pipeline_id, model=lease.model.ref,
    )  # fmt: skip


def frame_chunk_size(count: int, most: int, spread: int) -> int:
    """Frames per chunk, of `count` frames: a video spreads over `spread` chunks, each at most a
    bulk chunk and at least MIN_FRAME_CHUNK frames (fewer chunks amortise their writes)."""
    return max(1, min(most, max(MIN_FRAME_CHUNK, math.ceil(count / max(1, spread)))))


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


def chunked(item: LeasedItem, plan: FramePlan, size: int) -> frames.VideoFrames:
    """One video's frame items, in chunks numbered from 0 (the job's own numbers are given
    when they are added, under its lock)."""
    starts = chunk_starts(plan.gops, size)
    cut = np.zeros(len(plan.times), dtype=np.int64)
    cut[starts[1:]] = 1
    chunk_of = np.cumsum(cut).tolist()
    items = [
        NewItem(
            video.frame_key(item.key, t),
            c,
            item.source,
            frame_index=i if i >= 0 else None,  # past a cut: no frame of the video
            frame_time_s=t,
        )
        for t, i, c in zip(plan.times, plan.indices, chunk_of, strict=True)
    ]
    return frames.VideoFrames(item.id, item.key, items)


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
