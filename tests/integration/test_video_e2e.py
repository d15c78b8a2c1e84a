"""Videos on the real stack (API → Redis → Celery worker → Postgres + S3): frames as items.

OCR reads back the number each sampled frame shows; bad videos fail with sentences beside
images that succeed; an over-limit upload is refused at submission; a pipeline over a bucket of
videos skips what did not change, redoes what did, and drops a deleted video's frames.
"""

from __future__ import annotations

import io
import json
import uuid
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pyarrow.parquet as pq
from sqlalchemy import update

from devstack.images import solid
from devstack.jobs import wait_closed
from tests import videos
from tests.integration.test_bulk import manifest_of, stored
from tests.integration.test_http_jobs import wait_done
from tests.stack import SOURCE_BUCKET


def submit(
    client: httpx.Client,
    files: dict[str, bytes],
    model: str,
    fps: float | None = None,
    key: str | None = None,
) -> httpx.Response:
    parts = [("files", (name, data, "application/octet-stream")) for name, data in files.items()]
    form: dict[str, str] = {"model": model}
    if fps is not None:
        form["video_fps"] = str(fps)
    if key is not None:
        form["idempotency_key"] = key
    return client.post("/v1/jobs", data=form, files=parts)


def all_items(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    after = "0"
    while True:
        page = client.get(f"/v1/jobs/{job_id}/items", params={"limit": 1000, "after": after})
        body = page.json()
        out += body["items"]
        if not body["next"]:
            return out
        after = body["next"]


def test_ocr_reads_every_sampled_frame_of_a_numbered_clip(
    client: httpx.Client, tmp_path: Path
) -> None:
    """The issue's target: 30 s at 10 fps, sampled at 2 fps → 60 items, each text the number
    of the frame shown at its moment."""
    clip = videos.numbered(tmp_path / "count.mp4", 30, fps=10, size=(240, 160))
    response = submit(client, {"count.mp4": clip.read_bytes()}, "ocr", fps=2, key="count-1")
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=420)
    assert job["status"] == "completed", job
    assert (job["counts"]["total"], job["counts"]["succeeded"]) == (60, 60)

    items = sorted(all_items(client, job["id"]), key=lambda i: i["frame_time_s"])
    assert [i["key"] for i in items] == [f"count.mp4#t={k / 2:.3f}" for k in range(60)]
    assert [i["frame_index"] for i in items] == [5 * k for k in range(60)]
    texts = [(i["outputs"] or {}).get("text", "").strip() for i in items]
    assert texts == [str(5 * k) for k in range(60)]

    # The same key again answers the same job.
    again = submit(client, {"count.mp4": clip.read_bytes()}, "ocr", fps=2, key="count-1")
    assert again.status_code == 200 and again.json()["id"] == job["id"]

    # The README's DuckDB query over the results: frames grouped by their video.
    results = tmp_path / "results.parquet"
    results.write_bytes(client.get(f"/v1/jobs/{job['id']}/results").content)
    query = (
        f"SELECT source, count(*), min(frame_time_s), max(frame_time_s) FROM '{results}' "
        "GROUP BY source"
    )
    rows = duckdb.connect().execute(query).fetchall()
    assert rows == [("count.mp4", 60, 0.0, 29.5)]


def test_bad_videos_fail_with_sentences_and_images_beside_them_succeed(
    client: httpx.Client, tmp_path: Path
) -> None:
    whole = videos.numbered(tmp_path / "whole.mkv", 8, fps=10, size=(96, 64))
    files = {
        "photo.png": solid((200, 40, 40)),
        "cut.mkv": videos.cut(whole, tmp_path / "cut.mkv", 0.5).read_bytes(),
        "voice.mp4": videos.audio_only(tmp_path / "voice.mp4").read_bytes(),
        "empty.mov": b"",
        "fake.mp4": b"\x00\x00\x00\x18ftypisom" + b"\x00" * 200,
        "notes.mp4": b"a text, named as a video\n",
        "clip.webm": videos.plain(tmp_path / "clip.webm", 10, fps=10).read_bytes(),
    }
    response = submit(client, files, "phash", fps=2)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=240)
    assert job["status"] == "completed", job

    items = {i["key"]: i for i in all_items(client, job["id"])}
    assert items["photo.png"]["status"] == "succeeded"
    assert "audio only" in items["voice.mp4"]["error"]
    assert items["empty.mov"]["status"] == "failed" and items["empty.mov"]["error"]
    assert "not a video Kiln can read" in items["fake.mp4"]["error"]
    assert items["notes.mp4"]["error"] == "The file is neither an image nor a video Kiln can read."
    webm = [i for k, i in items.items() if k.startswith("clip.webm#t=")]
    assert len(webm) == 2 and all(i["status"] == "succeeded" for i in webm)
    cut = sorted(
        (i for k, i in items.items() if k.startswith("cut.mkv#")), key=lambda i: i["frame_time_s"]
    )
    assert len(cut) == 16  # every sampled moment of the header's 8 s is an item
    failed = [i for i in cut if i["status"] == "failed"]
    assert failed and cut[0]["status"] == "succeeded"
    assert failed[0]["error"].startswith("The video ends at ")
    assert failed[0]["error"].endswith(
        f"; {len(failed)} sampled frames after it were not decodable."
    )
    counts = job["counts"]
    assert counts["total"] == len(items) and counts["failed"] == len(failed) + 4
    assert counts["expanding"] == 0


def test_a_rate_above_the_video_s_own_gives_each_frame_once(
    client: httpx.Client, tmp_path: Path
) -> None:
    """A 10 fps clip sampled at 500 fps: its 20 frames, each once at the moment it is first on
    screen (its own time), not 50 items of each."""
    clip = videos.plain(tmp_path / "clip.mp4", 20, fps=10).read_bytes()
    response = submit(client, {"clip.mp4": clip, "photo.png": solid((20, 20, 200))}, "phash", 500)
    assert response.status_code == 202, response.text
    assert response.json()["counts"]["total"] == 2  # the video, until a worker expands it
    job = wait_done(client, response.json()["id"], timeout=240)
    c = job["counts"]
    assert (job["status"], c["total"], c["succeeded"], c["expanding"]) == ("completed", 21, 21, 0)
    frames = sorted(
        (i for i in all_items(client, job["id"]) if i["key"].startswith("clip.mp4#")),
        key=lambda i: i["frame_time_s"],
    )
    assert [i["frame_index"] for i in frames] == list(range(20))
    assert [i["key"] for i in frames] == [f"clip.mp4#t={k / 10:.3f}" for k in range(20)]


def test_an_upload_over_the_frame_limit_is_refused_at_submission(
    client: httpx.Client, tmp_path: Path
) -> None:
    # 1,000 frames a second, its header saying it lasts 300 s: at 500 fps, 150,000 frames
    fast = videos.plain(tmp_path / "fast.mkv", 1000, fps=1000, size=(16, 16))
    long = videos.claiming(fast, tmp_path / "long.mkv", 300.0)
    response = submit(client, {"long.mkv": long.read_bytes()}, "phash", fps=500)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert detail.startswith(
        "long.mkv: Sampling this 300.0 s video at 500 frames per second gives 150,000 frames"
    )
    assert "KILN_MAX_VIDEO_FRAMES" in detail
    # a rate above the video's own counts its frames: 300 s at 1 fps is 300 frames at 500 fps
    slow = videos.plain(tmp_path / "slow.mkv", 300, fps=1, size=(16, 16))
    taken = submit(client, {"slow.mkv": slow.read_bytes()}, "phash", fps=500)
    assert taken.status_code == 202, taken.text
    assert client.post(f"/v1/jobs/{taken.json()['id']}/cancel").status_code == 200
    bad = submit(client, {"x.mkv": long.read_bytes()}, "phash", fps=-1)
    assert bad.status_code == 422
    sentence = "video_fps must be between 0 (every frame) and 1000 frames per second, not -1."
    assert bad.json()["detail"] == sentence


def _pipeline(client: httpx.Client, prefix: str) -> dict[str, Any]:
    body = {
        "model": "phash",
        "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"},
        "pipeline": "dashcams",
        "video_fps": 1,
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return wait_closed(client, response.json()["id"], timeout=300)


def test_a_pipeline_of_videos_is_incremental(
    client: httpx.Client, s3: Any, settings: Any, tmp_path: Path
) -> None:
    prefix = "videos-inc/"
    clips = {
        # no extension: a video is known by its bytes
        f"{prefix}cam-a": videos.plain(tmp_path / "a.mp4", 40, fps=10).read_bytes(),
        f"{prefix}cam-b.mkv": videos.plain(tmp_path / "b.mkv", 30, fps=10).read_bytes(),
    }
    for key, data in clips.items():
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=data)

    first = _pipeline(client, prefix)
    c = first["counts"]
    assert (first["status"], c["total"], c["succeeded"]) == ("completed", 7, 7), first

    again = _pipeline(client, prefix)
    assert (again["counts"]["total"], again["counts"]["skipped"]) == (0, 2)

    shorter = videos.plain(tmp_path / "a2.mp4", 20, fps=10, size=(80, 48)).read_bytes()
    s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}cam-a", Body=shorter)  # new ETag
    changed = _pipeline(client, prefix)
    c = changed["counts"]
    assert (c["total"], c["succeeded"], c["skipped"]) == (2, 2, 1), changed
    library = _library(s3, settings, changed["id"])
    assert sorted(k for k in library if k.startswith(f"{prefix}cam-a")) == [
        f"{prefix}cam-a#t=0.000",
        f"{prefix}cam-a#t=1.000",
    ]  # the old cut's third and fourth second left with it

    s3.delete_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}cam-b.mkv")
    pruned = _pipeline(client, prefix)
    assert pruned["counts"]["deleted"] == 1
    assert not [k for k in _library(s3, settings, pruned["id"]) if "cam-b" in k]


def _library(s3: Any, settings: Any, job_id: str) -> list[str]:
    manifest = manifest_of(s3, settings, job_id)
    table = pq.read_table(io.BytesIO(stored(s3, settings, manifest["library"]["key"])))
    return list(table.column("key").to_pylist())


def test_json_jobs_take_video_fps(client: httpx.Client, s3: Any, tmp_path: Path) -> None:
    key = "videos-json/clip.ts"
    s3.put_object(
        Bucket=SOURCE_BUCKET, Key=key, Body=videos.plain(tmp_path / "c.ts", 30, fps=10).read_bytes()
    )
    body = {"model": "phash", "inputs": [{"uri": f"s3://{SOURCE_BUCKET}/{key}"}], "video_fps": 0}
    refused = client.post("/v1/jobs", json={**body, "video_fps": -1})  # a JSON int, echoed so
    assert refused.status_code == 422 and refused.json()["detail"].endswith(", not -1."), refused
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=240)
    assert (job["status"], job["counts"]["total"], job["counts"]["succeeded"]) == (
        "completed", 30, 30,
    ), json.dumps(job)  # fmt: skip


def test_search_finds_a_frames_look_alikes_across_videos(
    client: httpx.Client, tmp_path: Path
) -> None:
    """Embedded frames are searchable like images: a frame's nearest are the frames that show
    the same scene, in its own video and in another one."""
    from PIL import Image

    from tests.models import register_thumbnail_embedder

    model = register_thumbnail_embedder(client, tmp_path, "e2e-video-thumbs")
    scenes = [(230, 20, 20), (20, 20, 230), (20, 230, 20)]  # one second each

    def clip(name: str, order: list[int]) -> bytes:
        frames = (Image.new("RGB", (64, 48), scenes[order[i // 10]]) for i in range(30))
        return videos.encode(tmp_path / name, frames, 10, (64, 48)).read_bytes()

    files = {"a.mp4": clip("a.mp4", [0, 1, 2]), "b.mkv": clip("b.mkv", [2, 0, 1])}
    response = submit(client, files, model, fps=1)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=240)
    assert (job["status"], job["counts"]["succeeded"]) == ("completed", 6), job

    found = client.post(f"/v1/jobs/{job['id']}/search", json={"key": "a.mp4#t=0.000", "k": 2})
    assert found.status_code == 200, found.text
    keys = [hit["key"] for hit in found.json()["hits"]]
    assert keys[0] == "b.mkv#t=1.000"  # the other video's red second (the query is left out)
    thumb = client.get(found.json()["hits"][0]["thumbnail_url"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"


def test_a_job_s_answer_counts_its_videos_not_yet_expanded(
    client: httpx.Client, sessions: Any
) -> None:
    """On Postgres, through the API: open items named as videos and not frames are counted as
    `expanding` (a job no worker was told of, so none is expanded under the test's feet)."""
    from kiln.app.db import counters
    from kiln.app.db.models import Item, Job, JobStatus

    job_id = str(uuid.uuid4())
    keys = ["clip.mp4", "Dashcam.MOV", "photo.jpg", "done.mkv", "other.mp4#t=0.000"]
    with sessions() as session:
        session.add(Job(id=job_id, tenant="acme", model="phash", status=JobStatus.QUEUED))
        session.flush()
        session.add_all(Item(job_id=job_id, key=k, source=f"store:x/{k}") for k in keys)
        session.flush()
        session.execute(
            update(Item)
            .where(Item.job_id == job_id, Item.key == "done.mkv")
            .values(status="failed", error="Not decodable.")
        )
        session.execute(
            update(Item)
            .where(Item.job_id == job_id, Item.key == "other.mp4#t=0.000")
            .values(frame_index=0, frame_time_s=0.0)
        )
        counters.add(session, job_id, 0, counters.Tally(total=5, failed=1))
        session.commit()
    answer = client.get(f"/v1/jobs/{job_id}").json()
    assert (answer["counts"]["total"], answer["counts"]["expanding"]) == (5, 2)
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert client.get(f"/v1/jobs/{job_id}").json()["counts"]["expanding"] == 0
