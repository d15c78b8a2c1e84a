"""A cancel on the real stack (`kiln api`, `kiln worker`, Postgres, Redis, moto S3): a job
cancelled mid-run stops within a couple of seconds — its items that no batch had taken end
`cancelled`, wherever they were (queued, leased, in prep, in the Batcher's queue) — and its
counts, its items and its results file agree, with every item exactly once.

The API and worker here run with Kiln's own chunking and concurrency (32-item chunks, 16
chunks in flight), as a user's do: a 200-item job is then leased whole within a moment of
its submission, so nothing is left merely queued for the cancel to catch."""

from __future__ import annotations

import io
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from devstack.images import photo
from devstack.services import (
    Process,
    claim_redis_db,
    release_redis_db,
    start_api,
    start_worker,
)
from devstack.services import service_env as process_env
from kiln.app.tenants.auth import create_key
from tests import videos
from tests.integration.test_bulk import put_objects
from tests.stack import BUCKET, RUNNING, SOURCE_BUCKET

CLOSED = ("completed", "failed", "cancelled")
# Rows a cancel may let finish: the batches running at the cancel (runners × max batch 8 in
# these tests, and OCR's second stage for them) — never the rest of the job.
IN_FLIGHT_MOST = 40


@pytest.fixture(scope="module")
def defaults_client(
    service_env: dict[str, str], migrated: Any, sessions: Any, log_dir: Any
) -> Iterator[httpx.Client]:
    """An API and a worker of their own (and a Redis index: the session's worker neither
    helps nor steals), with the shipped chunk size and concurrency."""
    broker = claim_redis_db()
    env = process_env(
        {
            **{k: v for k, v in service_env.items() if k.startswith("KILN_")},
            "KILN_BROKER_URL": broker,
            "KILN_CHUNK_SIZE": "32",
            "KILN_BULK_CHUNK_SIZE": "32",
            "KILN_WORKER_CONCURRENCY": "16",
        }
    )
    started: list[Process] = []
    try:
        api, url = start_api(env, log_dir, name="cancel-api")
        started.append(api)
        RUNNING["cancel-api"] = api
        worker, _node = start_worker(env, log_dir, name="cancel-worker", node_prefix="cancel")
        started.append(worker)
        RUNNING["cancel-worker"] = worker
        with sessions() as session:
            key = create_key(session, "acme", (BUCKET, SOURCE_BUCKET)).secret
            session.commit()
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            yield http
    finally:
        for name in ("cancel-api", "cancel-worker"):
            RUNNING.pop(name, None)
        for proc in started:
            proc.stop()
        release_redis_db(broker)


def test_a_job_cancelled_mid_run_stops_within_seconds(defaults_client: httpx.Client) -> None:
    """200 OCR images over HTTP, cancelled once some have succeeded."""
    client = defaults_client
    files = [
        ("files", (f"scan-{i:03d}.jpg", photo(500 + i, (96, 72)), "image/jpeg")) for i in range(200)
    ]
    job = client.post("/v1/jobs", data={"model": "ocr"}, files=files).json()
    _wait_for(client, job["id"], lambda c: c["succeeded"] >= 16)

    answered = client.post(f"/v1/jobs/{job['id']}/cancel")
    cancelled_at = time.monotonic()
    assert answered.status_code == 200 and answered.json()["status"] in ("cancelling", "cancelled")
    at_cancel = answered.json()["counts"]
    job = _wait_closed(client, job["id"])
    settled_s = time.monotonic() - cancelled_at

    counts = job["counts"]
    ran_after = _ran_after(at_cancel, counts)
    unfinished = 200 - at_cancel["succeeded"] - at_cancel["failed"] - at_cancel["answered"]
    print(
        f"cancel with {unfinished} unfinished: {ran_after} more finished, "
        f"{counts['cancelled']} cancelled, closed {settled_s:.1f} s after the answer"
    )
    assert job["status"] == "cancelled"
    assert counts["pending"] == 0
    assert counts["succeeded"] + counts["failed"] + counts["cancelled"] == 200
    assert ran_after <= IN_FLIGHT_MOST, (at_cancel, counts)
    assert counts["cancelled"] >= unfinished - IN_FLIGHT_MOST
    assert settled_s < 15  # the batches in flight (OCR on a shared 2-core machine), no more
    _results_agree(client, job["id"], counts, total=200)


def test_a_bulk_job_cancelled_mid_run_stops(defaults_client: httpx.Client, s3: Any) -> None:
    client = defaults_client
    prefix = f"cancel-bulk-{time.time_ns()}/"
    put_objects(s3, [f"{prefix}{i:04d}.jpg" for i in range(300)], seed=7)
    body = {"model": "ocr", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}}
    job = client.post("/v1/jobs", json=body).json()
    _wait_for(client, job["id"], lambda c: c["succeeded"] >= 16)

    counts = _cancel_and_check(client, job["id"])
    # Listing stops too: what was listed is every item once, ended one way or the other.
    assert counts["succeeded"] + counts["failed"] + counts["cancelled"] == counts["total"]


def _cancel_and_check(client: httpx.Client, job_id: str) -> dict[str, int]:
    """Cancel the job, wait for it to close: nothing that was not done at the cancel's answer
    ran beyond the batches in flight, and its counts, items and results agree."""
    at_cancel = client.post(f"/v1/jobs/{job_id}/cancel").json()["counts"]
    job = _wait_closed(client, job_id)
    counts: dict[str, int] = job["counts"]
    assert job["status"] == "cancelled" and counts["pending"] == 0
    assert _ran_after(at_cancel, counts) <= IN_FLIGHT_MOST, (at_cancel, counts)
    _results_agree(client, job_id, counts, total=counts["total"])
    return counts


def _ran_after(at_cancel: dict[str, int], counts: dict[str, int]) -> int:
    """Items that ended after the cancel although they were not done at its answer (ended,
    or answered in a chunk that had yet to write them)."""
    done = at_cancel["succeeded"] + at_cancel["failed"] + at_cancel["answered"]
    return counts["succeeded"] + counts["failed"] - done


def _wait_for(
    client: httpx.Client, job_id: str, ready: Any, timeout: float = 180
) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts: dict[str, int] = client.get(f"/v1/jobs/{job_id}").json()["counts"]
        if ready(counts):
            return counts
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got going: {counts}")


def _wait_closed(client: httpx.Client, job_id: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in CLOSED:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not close in {timeout} s: {job}")


def _results_agree(client: httpx.Client, job_id: str, counts: dict[str, int], total: int) -> None:
    """The results file has every item once, with the statuses the counts and items say."""
    table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/results").content))
    keys = table.column("key").to_pylist()
    assert len(keys) == len(set(keys)) == total
    shard = Counter(table.column("status").to_pylist())
    assert shard == Counter(
        {s: counts[s] for s in ("succeeded", "failed", "cancelled") if counts[s]}
    )
    listed: Counter[str] = Counter()
    after = 0
    while True:
        page = client.get(f"/v1/jobs/{job_id}/items", params={"limit": 500, "after": after}).json()
        listed.update(item["status"] for item in page["items"])
        if page["next"] is None:
            break
        after = page["next"]
    assert listed == shard


def test_a_videos_frames_cancelled_mid_run_stop(
    defaults_client: httpx.Client, tmp_path: Path
) -> None:
    """A video expanded into 150 frame items, read by OCR: a cancel once some frames are done
    cancels the frames no batch has taken, in their own chunks as in any other."""
    client = defaults_client
    clip = videos.numbered(tmp_path / "count.mp4", 15, fps=10, size=(160, 120))
    files = [("files", ("count.mp4", clip.read_bytes(), "video/mp4"))]
    job = client.post("/v1/jobs", data={"model": "ocr", "video_fps": "0"}, files=files).json()
    _wait_for(client, job["id"], lambda c: c["total"] == 150 and c["succeeded"] >= 8)

    counts = _cancel_and_check(client, job["id"])
    assert counts["total"] == 150 and counts["cancelled"] > 0
