"""The whole path over HTTP: API → Redis → real worker → Postgres + S3."""

from __future__ import annotations

import io
import time
from typing import Any

import httpx
import pyarrow.parquet as pq
from sqlalchemy import select

from devstack.images import photo, truncated_jpeg
from kiln.app.db.models import Item
from tests.stack import BUCKET, SOURCE_BUCKET

DONE = {"completed", "failed", "cancelled"}


def wait_done(client: httpx.Client, job_id: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in DONE:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job}")


def upload(
    client: httpx.Client, files: dict[str, bytes], model: str = "detector"
) -> httpx.Response:
    parts = [("files", (name, data, "image/jpeg")) for name, data in files.items()]
    return client.post("/v1/jobs", data={"model": model}, files=parts)


def test_fifty_images_end_to_end(
    client: httpx.Client, sessions: Any, s3: Any, settings: Any
) -> None:
    files = {f"img-{i:02d}.jpg": photo(i) for i in range(50)}
    response = upload(client, files)
    assert response.status_code == 202, response.text
    job = response.json()
    assert response.headers["location"].endswith(f"/v1/jobs/{job['id']}")
    assert job["status"] in ("queued", "running")
    assert job["counts"]["total"] == 50

    job = wait_done(client, job["id"])
    assert job["status"] == "completed"
    assert job["counts"] == {
        "total": 50,
        "done": 50,
        "succeeded": 50,
        "failed": 0,
        "pending": 0,
        "running": 0,
        "answered": 0,
        "expanding": 0,
        "cancelled": 0,
        "skipped": 0,
        "deleted": 0,
        "known_failed": 0,
        "excluded": 0,
        "fell_back": 0,
        "fell_back_succeeded": 0,
    }
    assert job["items_per_second"] > 0
    assert job["started_at"] and job["finished_at"]

    # Every item: one row, succeeded once, with the detector's outputs.
    with sessions() as session:
        items = session.scalars(select(Item).where(Item.job_id == job["id"])).all()
    assert sorted(i.key for i in items) == sorted(files)
    assert all(i.status == "succeeded" and i.attempts == 1 for i in items)
    assert all(isinstance(i.outputs["detections"], list) for i in items)

    # Items page by page with the `next` cursor.
    seen, after = [], 0
    while True:
        page = client.get(
            f"/v1/jobs/{job['id']}/items", params={"limit": 20, "after": after}
        ).json()
        seen += [item["key"] for item in page["items"]]
        if page["next"] is None:
            break
        after = page["next"]
    assert seen == sorted(files)

    # One Parquet shard per chunk in S3, a manifest, and the combined results over HTTP.
    prefix = settings.storage_url.removeprefix(f"s3://{BUCKET}/")
    keys = [
        o["Key"]
        for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/results/{job['id']}/")[
            "Contents"
        ]
    ]
    assert sum(k.endswith(".parquet") for k in keys) == 7  # 50 items / chunk size 8
    assert any(k.endswith("manifest.json") for k in keys)
    inputs = s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/jobs/{job['id']}/inputs/")
    assert inputs["KeyCount"] == 50

    results = client.get(job["results_url"])
    assert results.status_code == 200
    table = pq.read_table(io.BytesIO(results.content))
    assert table.num_rows == 50
    assert sorted(table.column("key").to_pylist()) == sorted(files)
    assert set(table.column("status").to_pylist()) == {"succeeded"}
    assert "detections" in table.column_names


def test_bad_files_fail_alone(client: httpx.Client) -> None:
    files = {
        "good-1.jpg": photo(101),
        "truncated.jpg": truncated_jpeg(7),
        "notes.jpg": b"this is a text file, not a picture\n",
        "good-2.png": photo(102, fmt="PNG"),
    }
    job = wait_done(client, upload(client, files).json()["id"])
    assert job["status"] == "completed"
    assert job["counts"]["succeeded"] == 2 and job["counts"]["failed"] == 2
    failed = client.get(f"/v1/jobs/{job['id']}/items", params={"status": "failed"}).json()["items"]
    reasons = {item["key"]: item["error"] for item in failed}
    assert set(reasons) == {"truncated.jpg", "notes.jpg"}
    assert reasons["notes.jpg"] == "The file is neither an image nor a video Kiln can read."
    assert reasons["truncated.jpg"].endswith(".")


def test_s3_uris_and_a_missing_object(client: httpx.Client, s3: Any) -> None:
    s3.put_object(Bucket=SOURCE_BUCKET, Key="photos/a.jpg", Body=photo(201))
    body = {
        "model": "detector",
        "inputs": [
            {"uri": f"s3://{SOURCE_BUCKET}/photos/a.jpg"},
            {"uri": f"s3://{SOURCE_BUCKET}/photos/missing.jpg"},
        ],
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"])
    assert job["counts"]["succeeded"] == 1 and job["counts"]["failed"] == 1
    failed = client.get(f"/v1/jobs/{job['id']}/items", params={"status": "failed"}).json()["items"]
    assert failed[0]["error"] == f"No object at s3://{SOURCE_BUCKET}/photos/missing.jpg."


def test_idempotency_key_returns_the_same_job(client: httpx.Client, s3: Any) -> None:
    s3.put_object(Bucket=SOURCE_BUCKET, Key="photos/b.jpg", Body=photo(202))
    body = {
        "model": "detector",
        "inputs": [{"uri": f"s3://{SOURCE_BUCKET}/photos/b.jpg"}],
        "idempotency_key": "nightly-2026-11-22",
    }
    first = client.post("/v1/jobs", json=body)
    second = client.post("/v1/jobs", json=body)
    assert first.status_code == 202 and second.status_code == 200
    assert first.json()["id"] == second.json()["id"]


def test_cancel_keeps_finished_results(client: httpx.Client) -> None:
    files = {f"scan-{i:02d}.jpg": photo(300 + i) for i in range(40)}
    job = upload(client, files, model="ocr").json()
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] in ("cancelling", "cancelled")
    job = wait_done(client, job["id"], timeout=120)
    counts = job["counts"]
    assert job["status"] == "cancelled"
    assert counts["pending"] == 0 and counts["cancelled"] > 0
    assert counts["succeeded"] + counts["failed"] + counts["cancelled"] == 40
    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]


def test_list_jobs_newest_first(client: httpx.Client) -> None:
    page = client.get("/v1/jobs", params={"limit": 2}).json()
    assert len(page["jobs"]) == 2 and page["next"]
    more = client.get("/v1/jobs", params={"limit": 2, "after": page["next"]}).json()
    first_ids = {j["id"] for j in page["jobs"]}
    assert not first_ids & {j["id"] for j in more["jobs"]}
    stamps = [j["created_at"] for j in page["jobs"] + more["jobs"]]
    assert stamps == sorted(stamps, reverse=True)


def test_models_and_readiness(client: httpx.Client) -> None:
    names = {m["name"] for m in client.get("/v1/models").json()}
    assert {"detector", "ocr"} <= names
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}


def test_a_model_version_that_does_not_exist_is_422(client: httpx.Client) -> None:
    """`ocr:7` and `phash:99` name no version (a built-in has none): refused, never run as the
    built-in, whether the job comes as JSON, as a form or as a bulk source."""
    sentence = "Model 'ocr' has no version 7; built-in models have no versions: use 'ocr'."
    uri = {"inputs": [{"uri": f"s3://{SOURCE_BUCKET}/photos/a.jpg"}]}
    as_json = client.post("/v1/jobs", json={"model": "ocr:7", **uri})
    assert (as_json.status_code, as_json.json()["detail"]) == (422, sentence)
    as_form = upload(client, {"a.jpg": photo(1)}, model="phash:99")
    assert as_form.status_code == 422
    assert as_form.json()["detail"].startswith("Model 'phash' has no version 99;")
    bulk = client.post(
        "/v1/jobs", json={"model": "ocr:7", "source": {"s3": f"s3://{SOURCE_BUCKET}/photos/"}}
    )
    assert (bulk.status_code, bulk.json()["detail"]) == (422, sentence)
    assert client.get("/v1/models/ocr:7").status_code == 404
