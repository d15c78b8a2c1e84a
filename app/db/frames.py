"""A chunk's video items become their frame items, in the caller's one unit of work.

Under the job's lock: the videos the run still leases are taken out, their frames (cut into
chunks by the worker) are added in chunks numbered after the job's last, the job counts its new
chunks and its counters the change, and an incremental pipeline remembers the videos as done.
All of it commits together or not at all, so a crash leaves the video to be planned again and a
redelivered chunk finds it gone. Never commits: the caller owns the transaction.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace

from sqlalchemy import delete
from sqlalchemy.orm import Session

from kiln.app.db import counters, ingest, queries
from kiln.app.db.items import NewItem, insert_items
from kiln.app.db.models import Item, ItemStatus, JobStatus
from kiln.app.dispatch.contract import BULK


@dataclass(frozen=True)
class VideoFrames:
    """One video item of the chunk and its sampled frames, cut into chunks numbered from 0
    (the job's own numbers are only known under its lock)."""

    item_id: int
    key: str
    frames: Sequence[NewItem]

    @property
    def chunks(self) -> int:
        """How many chunk numbers the frames use."""
        return max((frame.chunk for frame in self.frames), default=-1) + 1


@dataclass(frozen=True)
class ChunkVideos:
    """What a chunk run asks: these videos of its chunk become their frames."""

    job_id: str
    chunk: int  # the chunk that leased them: its counter slot loses the videos
    owner: str  # the run's lease: only the videos it still holds are taken out
    videos: Sequence[VideoFrames]
    long: bool = False  # many frames: the job's chunks (and their re-sends) go to the bulk queue
    pipeline_id: int | None = None  # an incremental pipeline's run: remember the videos as done
    model: str = ""  # the job's model ref, with the pipeline's objects


class NotExpanded(enum.Enum):
    """Why nothing changed."""

    JOB_GONE = "job gone"
    JOB_NOT_RUNNING = "job not running"  # cancelling: each video ends as one cancelled item


@dataclass(frozen=True)
class Expanded:
    """What changed: the frame chunks to send once this commits, and where."""

    chunks: dict[int, list[int]]  # the new items' ids, by chunk
    queue: str  # the job's queue now
    videos: int  # the video items taken out (those the run still leased)


def replace_videos(session: Session, asked: ChunkVideos) -> Expanded | NotExpanded:
    """Replace the videos the run still leases by their frames (see the module's docstring)."""
    job = queries.lock_job(session, asked.job_id)  # job row first, as every writer does
    if job is None:
        return NotExpanded.JOB_GONE
    if job.status != JobStatus.RUNNING and job.status != JobStatus.QUEUED:
        return NotExpanded.JOB_NOT_RUNNING
    ids = [video.item_id for video in asked.videos]
    taken = take_out_leased(session, asked.job_id, ids, asked.owner)
    planned = [video for video in asked.videos if video.item_id in taken]
    frames, chunks = _numbered(planned, taken, first=job.chunk_count)
    sent = insert_items(session, job.id, frames)
    job.chunk_count += chunks
    out = counters.Tally(total=-len(taken))
    counters.add(session, job.id, counters.slot_of(asked.chunk), out)
    if asked.pipeline_id is not None:
        done = [(video.key, taken[video.item_id]) for video in planned]
        ingest.mark_videos_done(session, asked.pipeline_id, asked.model, done)
    if asked.long:
        job.queue = BULK
    return Expanded(sent, job.queue, len(taken))


def _numbered(
    videos: Sequence[VideoFrames], etags: dict[int, str | None], first: int
) -> tuple[list[NewItem], int]:
    """The videos' frames in chunks numbered from `first`, each with its video's ETag (a bulk
    job's); and how many chunks they fill."""
    frames: list[NewItem] = []
    chunks = 0
    for video in videos:
        etag, start = etags[video.item_id], first + chunks
        frames += [replace(f, chunk=start + f.chunk, etag=etag) for f in video.frames]
        chunks += video.chunks
    return frames, chunks


def take_out_leased(
    session: Session, job_id: str, ids: Sequence[int], owner: str
) -> dict[int, str | None]:
    """Delete the items among `ids` that `owner` still leases; their ETags (a bulk job's),
    by id."""
    gone = session.execute(
        delete(Item)
        .where(
            Item.job_id == job_id,
            Item.id.in_(ids),
            Item.lease_owner == owner,
            Item.status == ItemStatus.RUNNING,
        )
        .returning(Item.id, Item.etag),
        execution_options={"synchronize_session": False},
    )
    return {int(item_id): etag for item_id, etag in gone}
