"""A chunk's videos become their frame items (`app/db/frames.py`), on a migrated SQLite
database: only the videos the run still leases, in chunks after the job's last, counted."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from kiln.app.db import counters, frames, leases
from kiln.app.db.frames import ChunkVideos, Expanded, NotExpanded, VideoFrames
from kiln.app.db.items import NewItem
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus, PipelineObject
from kiln.app.dispatch.contract import BULK
from tests.app.db.test_ingest import pipeline
from tests.app.db.test_queries import items_of, make_job


def _leased(session: Session, statuses: int, owner: str = "run-a", **job: str) -> Job:
    """A job whose chunk 0 (`statuses` pending items, `k0`, `k1`, …) `owner` leased."""
    made = make_job(session, [ItemStatus.PENDING] * statuses, **job)
    leases.take(session, made.id, [i.id for i in items_of(session, made.id)], owner, 60)
    session.execute(update(Job).where(Job.id == made.id).values(chunk_count=1))
    session.commit()
    return made


def _video(item: Item, chunks: list[int]) -> VideoFrames:
    """The item as a video whose frames (one a second) fall in these chunks, from 0."""
    cut = [NewItem(f"{item.key}#t={t}", c, item.source) for t, c in enumerate(chunks)]
    return VideoFrames(item.id, item.key, cut)


def _asked(job: Job, videos: list[VideoFrames], **extra: Any) -> ChunkVideos:
    """What run-a, holding chunk 0, asks."""
    return ChunkVideos(job.id, 0, "run-a", videos, **extra)


def test_videos_become_frames_in_chunks_after_the_jobs_last(session: Session) -> None:
    job = _leased(session, 3)
    a, b, _image = items_of(session, job.id)
    session.execute(update(Item).where(Item.id == b.id).values(etag="e-b"))

    done = frames.replace_videos(session, _asked(job, [_video(a, [0, 0, 1]), _video(b, [0])]))
    session.commit()

    items = {i.key: i for i in items_of(session, job.id)}
    assert set(items) == {"k0#t=0", "k0#t=1", "k0#t=2", "k1#t=0", "k2"}  # the videos left
    assert [items[f"k0#t={t}"].chunk for t in range(3)] == [1, 1, 2]
    assert (items["k1#t=0"].chunk, items["k1#t=0"].etag) == (3, "e-b")  # its video's ETag
    assert all(i.status == ItemStatus.PENDING for k, i in items.items() if "#" in k)
    assert isinstance(done, Expanded)
    assert done.videos == 2 and done.queue == "interactive"
    by_key = {i.id: i.key for i in items.values()}
    assert {c: [by_key[i] for i in ids] for c, ids in done.chunks.items()} == {
        1: ["k0#t=0", "k0#t=1"],
        2: ["k0#t=2"],
        3: ["k1#t=0"],
    }
    session.expire_all()
    assert session.get(Job, job.id).chunk_count == 4  # type: ignore[union-attr]
    assert counters.read(session, job.id).total == 5 == counters.recount(session, job.id).total


def test_only_the_videos_the_run_still_leases_are_replaced(session: Session) -> None:
    job = _leased(session, 2)
    a, b = items_of(session, job.id)
    session.execute(update(Item).where(Item.id == a.id).values(lease_owner="run-b"))

    done = frames.replace_videos(session, _asked(job, [_video(a, [0, 1]), _video(b, [0, 1])]))
    session.commit()

    assert isinstance(done, Expanded) and done.videos == 1
    assert [(i.key, i.chunk) for i in items_of(session, job.id)] == [
        ("k0", 0),  # run-b's, to plan itself
        ("k1#t=0", 1),  # numbered on from the job's last chunk, no gap left for k0
        ("k1#t=1", 2),
    ]
    assert counters.difference(session, job.id) == counters.Tally()


def test_a_gone_or_cancelling_job_changes_nothing(session: Session) -> None:
    job = _leased(session, 1, status=JobStatus.CANCELLING)
    (video,) = items_of(session, job.id)
    asked = _asked(job, [_video(video, [0])])

    assert frames.replace_videos(session, asked) is NotExpanded.JOB_NOT_RUNNING
    gone = ChunkVideos("no-such-job", 0, "run-a", asked.videos)
    assert frames.replace_videos(session, gone) is NotExpanded.JOB_GONE
    session.commit()
    assert [i.key for i in items_of(session, job.id)] == ["k0"]


def test_a_long_video_sends_the_jobs_chunks_to_bulk(session: Session) -> None:
    job = _leased(session, 1)
    (video,) = items_of(session, job.id)

    done = frames.replace_videos(session, _asked(job, [_video(video, [0])], long=True))
    session.commit()

    assert isinstance(done, Expanded) and done.queue == BULK
    session.expire_all()
    assert session.get(Job, job.id).queue == BULK  # type: ignore[union-attr]


def test_a_pipelines_video_is_done_at_the_etag_its_frames_came_from(session: Session) -> None:
    pid = pipeline(session)
    job = _leased(session, 1)
    (video,) = items_of(session, job.id)
    session.execute(update(Item).where(Item.id == video.id).values(etag="e1"))
    session.add(PipelineObject(pipeline_id=pid, key="k0", etag="e1", seen_job=job.id))
    session.commit()

    asked = _asked(job, [_video(video, [0])], pipeline_id=pid, model="phash:1")
    frames.replace_videos(session, asked)
    session.commit()

    session.expire_all()
    seen = session.get(PipelineObject, (pid, "k0"))
    assert seen is not None and (seen.done_etag, seen.done_model) == ("e1", "phash:1")
