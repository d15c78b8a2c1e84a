"""Bulk jobs over a bucket with the real stack: moto S3, Postgres, Redis, `kiln api`/`kiln worker`.

Incremental reruns, a missing bucket, and interactive work finishing fast during a bulk job.
(The ingest crash-resume test has its own worker processes: tests/integration/test_bulk_resume.py.)
"""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from PIL import Image
from sqlalchemy import func, select

from devstack.images import photo
from devstack.jobs import wait_closed
from kiln.app.db.models import Item
from kiln.app.tenants.tenants import allow_bucket
from tests.stack import BUCKET, SOURCE_BUCKET


def put_objects(s3: Any, keys: list[str], seed: int = 0) -> None:
    """Small distinct JPEGs (the seed varies the picture, so a rewrite changes the ETag)."""

    def put(pair: tuple[int, str]) -> None:
        i, key = pair
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=photo(seed * 100_000 + i, (48, 36)))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, enumerate(keys)))


def run_pipeline(client: httpx.Client, prefix: str, name: str) -> dict[str, Any]:
    body = {
        "model": "phash",
        "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}", "include": ["*.jpg"]},
        "pipeline": name,
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["source"]["s3"] == body["source"]["s3"] and job["listing"] is True
    return wait_closed(client, job["id"], timeout=600)


def result_keys(client: httpx.Client, job_id: str) -> list[str]:
    table = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/results").content))
    return list(table.column("key").to_pylist())


# Over one S3 list page (1,000 keys), so listing crosses a page boundary and two folders.
INCREMENTAL_OBJECTS = 1500


def test_incremental_pipeline_processes_only_what_changed(
    client: httpx.Client, s3: Any, sessions: Any
) -> None:
    n = INCREMENTAL_OBJECTS
    prefix = "bulk-inc/"
    keys = [f"{prefix}d{i // 1000}/img-{i:05d}.jpg" for i in range(n)]
    put_objects(s3, keys)
    s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}notes.txt", Body=b"not an image")

    first = run_pipeline(client, prefix, "nightly")
    assert first["status"] == "completed", first
    c = first["counts"]
    assert (c["total"], c["succeeded"], c["failed"], c["skipped"], c["deleted"]) == (
        n,
        n,
        0,
        0,
        0,
    )  # fmt: skip  (notes.txt is not included)
    with sessions() as session:
        rows = session.scalar(select(func.count()).where(Item.job_id == first["id"]))
        distinct = session.scalar(
            select(func.count(func.distinct(Item.key))).where(Item.job_id == first["id"])
        )
    assert rows == distinct == n  # every object exactly once
    written = result_keys(client, first["id"])
    assert len(written) == len(set(written)) == n

    again = run_pipeline(client, prefix, "nightly")
    assert again["status"] == "completed"
    assert (again["counts"]["total"], again["counts"]["skipped"]) == (0, n)

    put_objects(s3, [f"{prefix}new/img-{i:05d}.jpg" for i in range(100)], seed=1)
    put_objects(s3, keys[:10], seed=2)  # new bytes: new ETags
    changed = run_pipeline(client, prefix, "nightly")
    c = changed["counts"]
    assert (c["total"], c["succeeded"], c["skipped"], c["deleted"]) == (110, 110, n - 10, 0)
    assert set(result_keys(client, changed["id"])) >= set(keys[:10])

    s3.delete_objects(Bucket=SOURCE_BUCKET, Delete={"Objects": [{"Key": k} for k in keys[100:105]]})
    pruned = run_pipeline(client, prefix, "nightly")
    c = pruned["counts"]
    assert (c["total"], c["skipped"], c["deleted"]) == (0, n + 100 - 5, 5)


def stored(s3: Any, settings: Any, key: str) -> bytes:
    """An object in Kiln's own store (the session's S3 prefix)."""
    prefix = settings.storage_url.removeprefix(f"s3://{BUCKET}/")
    body: bytes = s3.get_object(Bucket=BUCKET, Key=f"{prefix}/{key}")["Body"].read()
    return body


def manifest_of(s3: Any, settings: Any, job_id: str) -> dict[str, Any]:
    """The closed job's manifest (written just after the job's status closes: waited for)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            body = stored(s3, settings, f"results/{job_id}/manifest.json")
        except s3.exceptions.NoSuchKey:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
            continue
        manifest: dict[str, Any] = json.loads(body)
        return manifest


def groups_of(s3: Any, settings: Any, job_id: str) -> list[set[str]]:
    rows = pq.read_table(io.BytesIO(stored(s3, settings, f"results/{job_id}/groups.parquet")))
    found: dict[int, set[str]] = {}
    for row in rows.to_pylist():
        found.setdefault(row["group"], set()).add(row["key"])
    return list(found.values())


def smaller(data: bytes) -> bytes:
    """The picture at two thirds of its size, re-encoded: a near-duplicate, other bytes."""
    image = Image.open(io.BytesIO(data))
    buffer = io.BytesIO()
    image.resize((image.width * 2 // 3, image.height * 2 // 3)).save(buffer, "JPEG", quality=70)
    return buffer.getvalue()


def test_a_pipeline_run_groups_new_objects_with_the_whole_library(
    client: httpx.Client, s3: Any, settings: Any
) -> None:
    """A rerun processes only what is new, yet its groups compare the new objects with every
    object the pipeline has processed: a resized copy joins last run's original, and a byte
    copy is grouped as identical; deleted objects leave the library."""
    prefix = "bulk-library/"
    originals = {f"{prefix}img-{i}.jpg": photo(500 + i, (96, 72)) for i in range(4)}
    for key, body in originals.items():
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=body)
    first = run_pipeline(client, prefix, "library")
    assert manifest_of(s3, settings, first["id"])["library"]["objects"] == 4

    s3.put_object(
        Bucket=SOURCE_BUCKET,
        Key=f"{prefix}new-0.jpg",
        Body=smaller(originals[f"{prefix}img-0.jpg"]),
    )
    s3.put_object(
        Bucket=SOURCE_BUCKET, Key=f"{prefix}copy-1.jpg", Body=originals[f"{prefix}img-1.jpg"]
    )
    second = run_pipeline(client, prefix, "library")
    assert (second["counts"]["total"], second["counts"]["skipped"]) == (2, 4)
    manifest = manifest_of(s3, settings, second["id"])
    assert manifest["library"] == {
        "key": manifest["library"]["key"],
        "objects": 6,
        "added": 2,
    }
    assert manifest["identical"] == {"groups": 1, "items": 2}
    groups = groups_of(s3, settings, second["id"])
    assert {f"{prefix}img-0.jpg", f"{prefix}new-0.jpg"} in groups
    assert {f"{prefix}img-1.jpg", f"{prefix}copy-1.jpg"} in groups

    s3.delete_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}new-0.jpg")
    third = run_pipeline(client, prefix, "library")
    assert third["counts"]["deleted"] == 1
    assert manifest_of(s3, settings, third["id"])["library"]["objects"] == 5
    assert groups_of(s3, settings, third["id"]) == [{f"{prefix}img-1.jpg", f"{prefix}copy-1.jpg"}]


def test_a_pipeline_name_is_bound_to_its_source(client: httpx.Client) -> None:
    body = {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/elsewhere/"}}
    first = client.post("/v1/jobs", json={**body, "pipeline": "bound"})
    assert first.status_code == 202
    wait_closed(client, first.json()["id"], timeout=600)
    other = {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/other/"}}
    clash = client.post("/v1/jobs", json={**other, "pipeline": "bound"})
    assert clash.status_code == 409
    assert "another name" in clash.json()["detail"]


def test_a_missing_bucket_fails_the_job_with_a_sentence(client: httpx.Client, sessions) -> None:
    with sessions() as session:  # allowed, but gone (the allow-list does not know S3)
        allow_bucket(session, "acme", "no-such-bucket")
        session.commit()
    response = client.post(
        "/v1/jobs", json={"model": "phash", "source": {"s3": "s3://no-such-bucket/photos/"}}
    )
    assert response.status_code == 202, response.text
    job = wait_closed(client, response.json()["id"], timeout=120)
    assert job["status"] == "failed"
    assert job["error"] == "The bucket 'no-such-bucket' does not exist."


@pytest.mark.parametrize(
    "body",
    [
        {"model": "phash", "source": {"s3": "http://bucket/x"}},
        {
            "model": "phash",
            "source": {"s3": f"s3://{SOURCE_BUCKET}/"},
            "inputs": [{"uri": "s3://a/b"}],
        },
        {"model": "phash", "inputs": [{"uri": "s3://a/b"}], "pipeline": "p"},
        {"model": "text-embed", "source": {"s3": f"s3://{SOURCE_BUCKET}/"}},
        {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/"}, "pipeline": "bad name!"},
        {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/", "include": [""]}},
    ],
)
def test_bad_bulk_requests_get_a_sentence(client: httpx.Client, body: dict[str, Any]) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"]


def test_interactive_work_goes_ahead_of_a_bulk_backlog(client: httpx.Client, s3: Any) -> None:
    prefix = "bulk-load/"
    put_objects(s3, [f"{prefix}img-{i:05d}.jpg" for i in range(1500)], seed=3)
    image = photo(99, (320, 240))

    def one_image_seconds() -> float:
        started = time.perf_counter()
        response = client.post(
            "/v1/jobs",
            data={"model": "detector"},
            files=[("files", ("x.jpg", image, "image/jpeg"))],
        )
        job = wait_closed(client, response.json()["id"], timeout=120)
        assert job["counts"]["succeeded"] == 1, job
        return time.perf_counter() - started

    one_image_seconds()  # loads the detector
    idle = min(one_image_seconds() for _ in range(3))
    bulk = client.post(
        "/v1/jobs", json={"model": "detector", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}}
    ).json()
    backlog = _wait_for_backlog(client, bulk["id"], items=200)
    loaded = [one_image_seconds() for _ in range(3)]
    progress = client.get(f"/v1/jobs/{bulk['id']}").json()
    batch_s = 8 / max(progress["items_per_second"] or 1.0, 1.0)  # max_batch 8 in these tests
    client.post(f"/v1/jobs/{bulk['id']}/cancel")
    wait_closed(client, bulk["id"], timeout=300)
    print(
        f"one image: idle {idle:.3f} s, under bulk {[round(s, 3) for s in loaded]} s; "
        f"batch {batch_s:.3f} s; backlog {backlog} items"
    )
    # Behind the backlog it would wait backlog/rate seconds; ahead of it, about a batch or two.
    assert max(loaded) <= idle + 6 * batch_s, (idle, loaded, batch_s)
    assert max(loaded) < backlog * batch_s / 8 / 2  # well under the time to drain the backlog


def _wait_for_backlog(client: httpx.Client, job_id: str, items: int) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["counts"]["pending"] >= items and job["counts"]["succeeded"] > 0:
            return int(job["counts"]["pending"])
        time.sleep(0.2)
    raise TimeoutError("the bulk job never built a backlog")
