"""An estimate before running (POST /v1/jobs/estimate, `kiln bulk --dry-run`) on the real stack:
a rate measured by a small job (of images; of videos, for a frame's cost), then a prefix
estimated, run, and the estimate held to ±30% of the real run (submission to close) — images
alone, and images with videos. Creates nothing.

The issue's 5,000 images: bench/estimate.py (too slow for a test on this machine's 2 cores).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from devstack.images import photo
from devstack.jobs import wait_closed
from kiln.app.db.models import Job, WorkerFacts
from tests import videos
from tests.stack import SOURCE_BUCKET, run_kiln

MEASURE = 600  # the small job the pace is measured by
IMAGES = 1500  # a run of ~10 s: long enough that a moment of load is not the figure
TOLERANCE = 0.30


def put_images(s3: Any, prefix: str, count: int, seed: int) -> None:
    def put(i: int) -> None:
        body = photo(seed * 100_000 + i, (48, 36))  # distinct: the content cache never answers
        s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}d{i % 4}/img-{i:05d}.jpg", Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


def run(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The job closed, and its seconds from submission to close."""
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = wait_closed(client, response.json()["id"], timeout=600)
    assert job["status"] == "completed", job
    took = datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])
    return job, took.total_seconds()


def estimate(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/jobs/estimate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def jobs_count(sessions: Any) -> int:
    with sessions() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def bulk(prefix: str, **more: Any) -> dict[str, Any]:
    return {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}, **more}


def within(estimated: float, real: float) -> bool:
    return abs(estimated - real) <= TOLERANCE * real


def test_an_estimate_of_images_is_within_30_percent_of_the_run(
    client: httpx.Client, s3: Any, sessions: Any
) -> None:
    # A fleet that has run before (the session's worker is fresh: its first job pays a cold
    # start no warm fleet pays), then the small job the fleet's pace for phash is measured by.
    put_images(s3, "est-warm/", 16, seed=70)
    run(client, bulk("est-warm/"))
    put_images(s3, "est-measure/", MEASURE, seed=71)
    run(client, bulk("est-measure/"))

    prefix = "est-images/"
    put_images(s3, prefix, IMAGES, seed=72)
    s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}notes.txt", Body=b"left out by the glob")
    body = bulk(prefix)
    body["source"]["include"] = ["*.jpg"]
    before = jobs_count(sessions)
    found = estimate(client, body)
    assert jobs_count(sessions) == before  # nothing created
    assert (found["objects"], found["images"], found["videos"], found["items"]) == (
        IMAGES, IMAGES, 0, IMAGES,
    )  # fmt: skip
    assert found["sampled"] is False and found["listed"] == IMAGES
    assert found["bytes"] > 0 and found["workers"] >= 1 and found["rate_per_s"] > 0

    job, took = run(client, body)
    assert job["counts"]["total"] == IMAGES
    assert within(found["seconds"], took), f"estimated {found}, ran {took:.1f} s"
    with sessions() as session:  # what the estimate takes a worker to run at once
        capacity = [row.facts["capacity"] for row in session.scalars(select(WorkerFacts))]
    assert capacity and all(c["cores"] >= 1 and c["prep_processes"] >= 0 for c in capacity)


def test_an_estimate_of_images_and_videos_counts_frames_and_time(
    client: httpx.Client, s3: Any, tmp_path: Path
) -> None:
    # what a frame costs, measured by a small job of videos alone (an image's: the test above)
    for name, frames in (("m1.mp4", 120), ("m2.mkv", 100), ("m3.mp4", 110), ("m4.mov", 90)):
        data = videos.plain(tmp_path / name, frames, fps=10).read_bytes()
        s3.put_object(Bucket=SOURCE_BUCKET, Key=f"est-measure-v/{name}", Body=data)
    run(client, bulk("est-measure-v/", video_fps=5))

    prefix = "est-mixed/"
    put_images(s3, prefix, 600, seed=73)
    clips = {
        f"{prefix}v/a.mp4": videos.plain(tmp_path / "a.mp4", 120, fps=10),  # 12 s
        f"{prefix}v/b.mkv": videos.plain(tmp_path / "b.mkv", 90, fps=10),  # 9 s
        f"{prefix}v/c.mov": videos.plain(tmp_path / "c.mov", 150, fps=10, faststart=True),
        f"{prefix}v/cam-d": videos.plain(tmp_path / "d.mp4", 60, fps=10),  # a video by its bytes
    }
    for key, path in clips.items():
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=path.read_bytes())
    body = bulk(prefix, video_fps=5)
    found = estimate(client, body)
    assert (found["objects"], found["images"], found["videos"]) == (604, 600, 4)
    assert found["items"] == 600 + found["frames"]

    job, took = run(client, body)
    # 42 s of video at 5 frames a second; a header's duration may round a frame up
    assert 210 <= job["counts"]["total"] - 600 <= found["frames"] <= 210 + 4, (found, job)
    assert within(found["seconds"], took), f"estimated {found}, ran {took:.1f} s"


def test_bad_estimates_get_a_sentence_and_create_nothing(
    client: httpx.Client, other_client: httpx.Client, sessions: Any
) -> None:
    before = jobs_count(sessions)
    cases = [
        (client, {"model": "phash", "inputs": [{"text": "a"}]}, 422, "source"),
        (client, {"model": "nope", "source": {"s3": f"s3://{SOURCE_BUCKET}/x/"}}, 422, "nope"),
        (client, {"model": "phash", "source": {"s3": "http://x/y"}}, 422, "S3 URI"),
        (client, bulk("x/", video_fps=-1), 422, "video_fps"),
        (client, {"model": "phash", "source": {"s3": "s3://no-such-bucket-here/x/"}}, 403, ""),
        (other_client, bulk("x/"), 200, ""),  # globex may read the stack's buckets too
    ]
    for http, body, code, words in cases:
        response = http.post("/v1/jobs/estimate", json=body)
        assert response.status_code == code, (body, response.text)
        if code != 200:
            assert words in response.json()["detail"], response.text
    assert jobs_count(sessions) == before


def test_kiln_bulk_dry_run_prints_the_estimate(
    client: httpx.Client, s3: Any, api_url: str, service_env: dict[str, str]
) -> None:
    put_images(s3, "est-cli/", 12, seed=74)
    key = client.headers["Authorization"].removeprefix("Bearer ")
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": key}
    args = ("bulk", f"s3://{SOURCE_BUCKET}/est-cli/", "--model", "phash", "--dry-run")
    table = run_kiln(env, *args)
    assert table.returncode == 0, table.stderr
    assert "no job created" in table.stdout and "12" in table.stdout, table.stdout
    answer = run_kiln(env, *args, "--json")
    assert answer.returncode == 0, answer.stderr
    found = json.loads(answer.stdout)
    assert (found["objects"], found["items"], found["sampled"]) == (12, 12, False)
