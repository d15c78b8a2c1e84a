"""A video item becomes its sampled frames (`workers/chunk/expand.py`), with `process_chunk`
on SQLite and a local store: every sampled moment one item, exactly once, redelivery and a lost
lease included; bad videos fail as items, next to images that succeed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select, update

from devstack.images import solid
from kiln.app.db import counters
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus
from kiln.app.dispatch.stub import Enqueued, RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.workers.chunk.expand import chunk_starts, chunked, frame_chunk_size
from kiln.workers.chunk.run import process_chunk
from kiln.workers.prep.video import FramePlan
from kiln.workers.runtime import WorkerRuntime
from tests import videos


def _submit(
    runtime: WorkerRuntime, files: list[tuple[str, bytes]], fps: float | None = 2
) -> tuple[str, list[Enqueued]]:
    dispatcher = RecordingDispatcher()
    options = {} if fps is None else {"video_fps": fps}
    request = JobRequest(
        tenant="acme",
        model="phash",
        uploads=[Upload(name, data) for name, data in files],
        options=options,
    )
    with runtime.sessions() as session:
        job = submit_job(session, runtime.store, dispatcher, runtime.settings, request).job
    return job.id, dispatcher.calls


def _drain(runtime: WorkerRuntime, calls: list[Enqueued]) -> RecordingDispatcher:
    """Run every message, and every message those runs send, until none is left."""
    sent = RecordingDispatcher()
    pending = list(calls)
    while pending:
        call = pending.pop(0)
        before = len(sent.calls)
        process_chunk(runtime, call.job_id, call.chunk, call.item_ids, dispatcher=sent)
        pending += sent.calls[before:]
    return sent


def _items(runtime: WorkerRuntime, job_id: str) -> list[Item]:
    with runtime.sessions() as session:
        return list(session.scalars(select(Item).where(Item.job_id == job_id).order_by(Item.id)))


def test_a_video_becomes_one_item_per_sampled_frame(runtime: WorkerRuntime, tmp_path: Path) -> None:
    clip = videos.plain(tmp_path / "clip.mp4", frames=40, fps=10)  # 4 s
    job_id, calls = _submit(
        runtime, [("a.png", solid((200, 10, 10))), ("clip.mp4", clip.read_bytes())]
    )
    sent = _drain(runtime, calls)

    items = _items(runtime, job_id)
    frames = [i for i in items if i.frame_time_s is not None]
    assert [i.key for i in frames] == [f"clip.mp4#t={t:.3f}" for t in np.arange(0, 4, 0.5)]
    assert [i.frame_index for i in frames] == list(range(0, 40, 5))
    assert all(i.status == ItemStatus.SUCCEEDED and i.outputs for i in items)
    assert {i.key for i in items} - {i.key for i in frames} == {"a.png"}  # the video item left
    assert sent.calls and all(c.job_id == job_id for c in sent.calls)
    with runtime.sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == "completed"
        tally = counters.read(session, job_id)
    assert (tally.total, tally.succeeded, tally.failed) == (9, 9, 0)


def test_bad_videos_fail_as_items_beside_good_inputs(
    runtime: WorkerRuntime, tmp_path: Path
) -> None:
    whole = videos.numbered(tmp_path / "whole.mkv", 6, fps=10, size=(96, 64))
    files = [
        ("ok.png", solid((10, 200, 10))),
        ("cut.mkv", videos.cut(whole, tmp_path / "cut.mkv", 0.5).read_bytes()),
        ("voice.mp4", videos.audio_only(tmp_path / "voice.mp4").read_bytes()),
        ("empty.mp4", b""),
        ("fake.mp4", b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64),
    ]
    job_id, calls = _submit(runtime, files)
    _drain(runtime, calls)

    by_key = {i.key: i for i in _items(runtime, job_id)}
    assert by_key["ok.png"].status == ItemStatus.SUCCEEDED
    assert "no video stream (audio only)" in (by_key["voice.mp4"].error or "")
    assert by_key["empty.mp4"].status == ItemStatus.FAILED and by_key["empty.mp4"].error
    assert "not a video Kiln can read" in (by_key["fake.mp4"].error or "")
    cut = sorted(
        (i for i in by_key.values() if i.key.startswith("cut.mkv#")),
        key=lambda i: i.frame_time_s or 0,
    )
    assert len(cut) == 12  # the header's 6 s at 2 fps: every sampled moment is an item
    failed = [i for i in cut if i.status == ItemStatus.FAILED]
    assert failed and cut[0].status == ItemStatus.SUCCEEDED
    assert all(i.status == ItemStatus.FAILED for i in cut[len(cut) - len(failed) :])  # the tail
    assert failed[-1].error is not None
    assert failed[-1].error.startswith("The video ends at ")
    assert failed[-1].error.endswith(f"{len(failed)} sampled frames after it were not decodable.")


def test_a_redelivered_video_chunk_adds_no_frames_twice(
    runtime: WorkerRuntime, tmp_path: Path
) -> None:
    clip = videos.plain(tmp_path / "clip.mkv", frames=20, fps=10)
    job_id, calls = _submit(runtime, [("clip.mkv", clip.read_bytes())])
    first = RecordingDispatcher()
    process_chunk(runtime, job_id, calls[0].chunk, calls[0].item_ids, dispatcher=first)
    again = RecordingDispatcher()
    process_chunk(runtime, job_id, calls[0].chunk, calls[0].item_ids, dispatcher=again)
    assert not again.calls  # the video item is gone: nothing to plan again
    _drain(runtime, first.calls)
    with runtime.sessions() as session:
        keys = session.scalars(select(Item.key).where(Item.job_id == job_id)).all()
        assert (
            session.scalar(select(func.count()).select_from(Item).where(Item.job_id == job_id)) == 4
        )
    assert sorted(keys) == [f"clip.mkv#t={t:.3f}" for t in (0, 0.5, 1, 1.5)]


def test_a_run_that_lost_its_lease_plans_nothing(
    runtime: WorkerRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another run took the video item over while this one read it: only the owner expands."""
    from kiln.workers.chunk import expand

    clip = videos.plain(tmp_path / "clip.mp4", frames=20, fps=10)
    job_id, calls = _submit(runtime, [("clip.mp4", clip.read_bytes())])
    real = expand.expand_videos

    def stolen(rt: WorkerRuntime, lease, rows, dispatcher):  # type: ignore[no-untyped-def]
        with rt.sessions() as session, session.begin():
            session.execute(update(Item).where(Item.job_id == job_id).values(lease_owner="other"))
        return real(rt, lease, rows, dispatcher)

    monkeypatch.setattr("kiln.workers.chunk.run.expand_videos", stolen)
    sent = RecordingDispatcher()
    process_chunk(runtime, job_id, calls[0].chunk, calls[0].item_ids, dispatcher=sent)
    items = _items(runtime, job_id)
    assert [i.key for i in items] == ["clip.mp4"] and not sent.calls


def test_every_frame_at_fps_zero(runtime: WorkerRuntime, tmp_path: Path) -> None:
    clip = videos.plain(tmp_path / "clip.avi", frames=25, fps=10)
    job_id, calls = _submit(runtime, [("clip.avi", clip.read_bytes())], fps=0)
    _drain(runtime, calls)
    frames = _items(runtime, job_id)
    assert [i.frame_index for i in frames] == list(range(25))
    assert all(i.status == ItemStatus.SUCCEEDED for i in frames)


def test_frame_chunks_begin_at_keyframes() -> None:
    gops = [0] * 10 + [1] * 10 + [2] * 10 + [3] * 3
    assert chunk_starts(gops, 8) == [0, 10, 20, 30]
    assert chunk_starts([0] * 40, 8) == [0, 16, 32]  # one long GOP still spreads
    assert chunk_starts([], 8) == []
    assert frame_chunk_size(60, 512, 4) == 32
    assert frame_chunk_size(18_000, 512, 4) == 512
    assert frame_chunk_size(1_800, 512, 4) == 450
    assert frame_chunk_size(3_200, 512, 32) == 100


def test_a_videos_frames_are_cut_into_chunks_numbered_from_zero() -> None:
    """The job's own numbers come under its lock (`app/db/frames.py`), as does the ETag."""
    item = LeasedItem(7, "job", "clip.mp4", "store:clip", None, chunk=3, attempts=1)
    plan = FramePlan([0.0, 0.5, 1.0, 1.5], [0, 5, 10, -1], 1.6, [0, 0, 1, -1])
    video = chunked(item, plan, 2)
    assert (video.item_id, video.key, video.chunks) == (7, "clip.mp4", 2)
    assert [(f.key, f.chunk, f.frame_index) for f in video.frames] == [
        ("clip.mp4#t=0.000", 0, 0),
        ("clip.mp4#t=0.500", 0, 5),
        ("clip.mp4#t=1.000", 1, 10),
        ("clip.mp4#t=1.500", 1, None),  # past a cut: no frame of the video
    ]
    assert {(f.source, f.etag) for f in video.frames} == {("store:clip", None)}


def test_a_video_of_a_cancelling_job_ends_as_one_cancelled_item(
    runtime: WorkerRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.workers.chunk import expand

    clip = videos.plain(tmp_path / "clip.mp4", frames=20, fps=10)
    job_id, calls = _submit(runtime, [("clip.mp4", clip.read_bytes())])
    real = expand.expand_videos

    def cancelled_meanwhile(rt, lease, rows, dispatcher):  # type: ignore[no-untyped-def]
        with rt.sessions() as session, session.begin():
            session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.CANCELLING))
        return real(rt, lease, rows, dispatcher)

    monkeypatch.setattr("kiln.workers.chunk.run.expand_videos", cancelled_meanwhile)
    sent = RecordingDispatcher()
    process_chunk(runtime, job_id, calls[0].chunk, calls[0].item_ids, dispatcher=sent)
    items = _items(runtime, job_id)
    assert [(i.key, i.status) for i in items] == [("clip.mp4", ItemStatus.CANCELLED)]
    assert not sent.calls
