"""kiln.AsyncClient against the same stand-in API: the same calls as kiln.Client, awaited."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

import kiln
from tests.app.client.fake_api import FakeApi, job_json, parquet


@pytest.fixture
def api() -> FakeApi:
    return FakeApi()


def _client(api: FakeApi) -> kiln.AsyncClient:
    return kiln.AsyncClient("http://api", "kiln_key", transport=api.transport())


def test_submit_wait_items_and_results(api: FakeApi, tmp_path: Path) -> None:
    photo = tmp_path / "cat.jpg"
    photo.write_bytes(b"jpeg")
    api.on("POST", "/v1/jobs", job_json(), status=202)
    closes = iter(["running", "completed"])
    api.on("GET", "/v1/jobs/j1", lambda _r: httpx.Response(200, json=job_json(status=next(closes))))
    item = {"key": "cat.jpg", "status": "succeeded", "error": None, "attempts": 1,
            "duration_ms": 3.0, "outputs": {"hash": "ff00"}}  # fmt: skip
    api.on("GET", "/v1/jobs/j1/items", {"items": [item], "next": None})
    rows = [{"key": "cat.jpg", "status": "succeeded"}]
    api.on("GET", "/v1/jobs/j1/results", lambda _r: httpx.Response(200, content=parquet(rows)))
    seen: list[str] = []

    async def progress(job: kiln.JobOut) -> None:  # a coroutine is awaited
        seen.append(job.status)

    async def run() -> tuple[kiln.JobOut, list[kiln.ItemOut], list[dict[str, object]]]:
        async with _client(api) as client:
            job = await client.wait(
                await client.submit("phash", files=[photo]), progress=progress, poll_interval=0.01
            )
            items = [i async for i in client.items(job)]
            table = await client.results(job)
            return job, items, table.to_pylist()

    job, items, table = asyncio.run(run())
    assert job.status == "completed" and seen == ["queued", "running", "completed"]
    assert items[0].outputs == {"hash": "ff00"}
    assert table == rows


def test_errors_retry_and_the_webhook_secret(api: FakeApi) -> None:
    api.on("GET", "/v1/jobs/nope", {"detail": "There is no job nope."}, status=404)
    api.on("POST", "/v1/jobs/j1/retry", job_json("j2", retry_of="j1"), status=201)
    api.on("GET", "/v1/webhooks/secret", {"secret": "whsec_abc"})

    async def run() -> tuple[kiln.JobOut, str]:
        async with _client(api) as client:
            with pytest.raises(kiln.NotFoundError, match="There is no job nope"):
                await client.job("nope")
            return await client.retry("j1", idempotency_key="r1"), await client.webhook_secret()

    again, secret = asyncio.run(run())
    assert again.retry_of == "j1" and secret == "whsec_abc"
    assert api.seen[1].headers["Idempotency-Key"] == "r1"


def test_jobs_and_shards_iterate_asynchronously(api: FakeApi) -> None:
    api.on("GET", "/v1/jobs", {"jobs": [job_json("j2"), job_json("j1")], "next": None})
    api.on(
        "GET",
        "/v1/jobs/j1/results/urls",
        {
            "job_id": "j1",
            "status": "running",
            "expires_at": "2026-11-29T05:00:00Z",
            "manifest": None,
            "shards": [{"key": "j1/0.parquet", "url": "http://s3.local/b/j1/0.parquet?sig=1"}],
        },
    )
    shard = parquet([{"key": "a", "status": "succeeded"}])
    api.on("GET", "/b/j1/0.parquet", lambda _r: httpx.Response(200, content=shard))

    async def run() -> tuple[list[str], list[int]]:
        async with _client(api) as client:
            ids = [j.id async for j in client.jobs(limit=5)]
            rows = [t.num_rows async for t in client.iter_result_shards("j1")]
            return ids, rows

    assert asyncio.run(run()) == (["j2", "j1"], [1])
