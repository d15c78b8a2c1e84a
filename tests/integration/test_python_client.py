"""kiln.Client against the real stack (`kiln api`, a worker, Postgres, Redis, moto S3): what the
README's examples do not show — an item's failure sentence, the same key answering the same
job, shards that add up to the one file, URIs, a download, the sentence of a refusal, a
retry, an estimate, and a webhook's delivery verified with the tenant's secret.

On the stack that sends webhooks (`webhook_stack`: the API and worker have a signing secret
and may call the test's receiver on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from standardwebhooks.webhooks import Webhook

import kiln
from devstack.images import solid
from devstack.services import wait_for
from tests.stack import SOURCE_BUCKET, WebhookStack


@pytest.fixture(scope="module")
def py_key(webhook_stack: WebhookStack) -> str:
    return webhook_stack.key("pyclient")


@pytest.fixture(scope="module")
def py(webhook_stack: WebhookStack, py_key: str) -> Iterator[kiln.Client]:
    with kiln.Client(webhook_stack.url, py_key) as client:
        yield client


def test_a_job_s_items_results_and_shards_agree(py: kiln.Client, tmp_path: Path) -> None:
    files = [(f"{n}.png", solid((20 * n, 100, 200))) for n in range(12)]
    files.append(("broken.jpg", b"\xff\xd8 not really a JPEG"))
    job = py.submit("phash", files=files, idempotency_key="pyclient-1")
    assert py.submit("phash", files=files, idempotency_key="pyclient-1").id == job.id
    seen: list[int] = []
    done = py.wait(job, progress=lambda j: seen.append(j.counts.done), poll_interval=0.2)
    assert done.status == "completed" and seen[-1] == done.counts.total == 13
    assert seen == sorted(seen)  # progress only grows
    assert (done.counts.succeeded, done.counts.failed) == (12, 1)

    [failed] = py.items(done, status="failed")
    assert failed.key == "broken.jpg" and failed.error  # the worker's sentence
    assert len(list(py.items(done, page_size=5))) == 13  # three pages

    table = py.results(done)
    by_key = dict(
        zip(table.column("key").to_pylist(), table.column("status").to_pylist(), strict=True)
    )
    assert by_key["broken.jpg"] == "failed" and len(by_key) == 13
    shards = list(py.iter_result_shards(done))
    assert len(shards) > 1  # chunks of 8 (the stack's KILN_CHUNK_SIZE): shard by shard
    assert sorted(k for s in shards for k in s.column("key").to_pylist()) == sorted(by_key)
    out = tmp_path / "results.parquet"
    py.download_results(done, out)
    assert pq.read_table(out).num_rows == 13
    assert done.id in [j.id for j in py.jobs(status="completed", limit=10)]


def test_uris_run_and_a_refusal_raises_the_api_s_sentence(py: kiln.Client, s3: object) -> None:
    s3.put_object(Bucket=SOURCE_BUCKET, Key="pyclient/a.png", Body=solid((1, 2, 3)))  # type: ignore[attr-defined]
    job = py.wait(py.submit("phash", uris=[f"s3://{SOURCE_BUCKET}/pyclient/a.png"]))
    assert job.counts.succeeded == 1
    with pytest.raises(kiln.InvalidRequestError, match="max_distance") as refused:
        py.submit("phash", uris=["s3://x/y.png"], options={"max_distance": 99})
    assert refused.value.status == 422 and refused.value.detail.endswith(".")
    with pytest.raises(kiln.ConflictError, match="only open jobs can be cancelled"):
        py.cancel(job)
    with (
        kiln.Client(py.base_url, "kiln_wrong") as stranger,
        pytest.raises(kiln.AuthError, match="unknown or revoked"),
    ):
        stranger.job(job.id)


def test_a_retry_replays_the_failed_items_once_per_key(py: kiln.Client, py_key: str) -> None:
    files = [("a.png", solid((1, 2, 3))), ("b.png", solid((4, 5, 6))), ("bad.jpg", b"\xff\xd8 no")]
    done = py.wait(py.submit("phash", files=files, expires_after="2h"), poll_interval=0.2)
    assert (done.counts.succeeded, done.counts.failed) == (2, 1)
    assert done.expires_at and done.finished_at  # an upload's own retention (a form field)
    assert (done.expires_at - done.finished_at).total_seconds() == 2 * 3600

    again = py.retry(done, idempotency_key="pyclient-retry-1")
    assert again.retry_of == done.id and again.model == done.model
    assert py.retry(done.id, idempotency_key="pyclient-retry-1").id == again.id  # the same key

    async def from_asyncio() -> tuple[str, str]:
        async with kiln.AsyncClient(py.base_url, py_key) as client:
            same = await client.retry(done, idempotency_key="pyclient-retry-1")
            return same.id, (await client.webhook_secret())

    assert asyncio.run(from_asyncio()) == (again.id, py.webhook_secret())
    replayed = py.wait(again, poll_interval=0.2)
    assert replayed.counts.total == 1  # only the failed item; and it fails again
    assert [i.key for i in py.items(replayed)] == ["bad.jpg"]
    assert py.job(done).retries == [again.id]
    assert replayed.expires_at and replayed.finished_at  # the original's retention, kept
    assert (replayed.expires_at - replayed.finished_at).total_seconds() == 2 * 3600

    whole = py.wait(py.submit("phash", files=files[:1]), poll_interval=0.2)
    with pytest.raises(kiln.ConflictError, match="failed") as refused:
        py.retry(whole)  # nothing failed: nothing to replay
    assert refused.value.status == 409


def test_an_estimate_counts_the_prefix_and_creates_no_job(py: kiln.Client, s3: Any) -> None:
    sizes = []
    for n in range(5):
        body = solid((n, 50, 100))
        s3.put_object(Bucket=SOURCE_BUCKET, Key=f"pyestimate/{n}.png", Body=body)
        sizes.append(len(body))
    s3.put_object(Bucket=SOURCE_BUCKET, Key="pyestimate/notes.txt", Body=b"left out")
    before = [j.id for j in py.jobs(limit=5)]

    found = py.estimate("phash", f"s3://{SOURCE_BUCKET}/pyestimate/", include=["*.png"])
    assert isinstance(found, kiln.EstimateOut)
    assert (found.objects, found.images, found.videos, found.items) == (5, 5, 0, 5)
    assert found.bytes == sum(sizes) and not found.sampled and found.workers >= 1
    assert found.note  # how it was made, in a sentence
    assert [j.id for j in py.jobs(limit=5)] == before  # no job
    with pytest.raises(kiln.InvalidRequestError, match="max_distance") as refused:
        py.estimate("phash", f"s3://{SOURCE_BUCKET}/pyestimate/", options={"max_distance": 99})
    assert refused.value.status == 422


class Receiver:
    """A webhook receiver on 127.0.0.1 that verifies each request with the tenant's secret."""

    def __init__(self, secret: str, fail_first: int = 0) -> None:
        self.verifier = Webhook(secret)
        self.events: dict[str, dict[str, Any]] = {}  # webhook-id → the verified event
        self.seen: list[str] = []  # every verified request's webhook-id, in order
        self.bad = 0
        self.fail_left = fail_first  # answer 500 to this many verified requests first
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                try:
                    event = receiver.verifier.verify(body, dict(self.headers.items()))
                except Exception:
                    receiver.bad += 1
                    self.send_response(400)
                else:
                    receiver.seen.append(self.headers["webhook-id"])
                    if receiver.fail_left > 0:
                        receiver.fail_left -= 1
                        self.send_response(500)
                    else:
                        receiver.events[self.headers["webhook-id"]] = event
                        self.send_response(204)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/kiln"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_webhook_is_delivered_signed_and_its_deliveries_read(py: kiln.Client) -> None:
    secret = py.webhook_secret()
    assert secret.startswith("whsec_")
    receiver = Receiver(secret)
    try:
        job = py.submit("phash", files=[("w.png", solid((9, 9, 9)))], notify={"url": receiver.url})
        done = py.wait(job, poll_interval=0.2)

        def delivered() -> list[kiln.DeliveryOut] | None:
            found = py.deliveries(done)
            return found if found and found[0].status == "delivered" else None

        wait_for(lambda: delivered() is not None, 30, "the webhook delivered", interval=0.2)
        [delivery] = delivered() or []
        assert (delivery.event, delivery.attempts, delivery.last_status) == ("completed", 1, 204)
        assert receiver.bad == 0 and list(receiver.events) == [delivery.id]
        event = receiver.events[delivery.id]
        assert event["type"] == "job.completed" and event["data"]["id"] == done.id
        assert event["data"]["counts"]["succeeded"] == 1
        notify = py.job(done).notify
        assert notify is not None and (notify.url, notify.events) == (
            receiver.url,
            ["completed", "failed", "cancelled"],
        )
    finally:
        receiver.stop()
    with pytest.raises(kiln.InvalidRequestError, match="http") as refused:
        py.submit("phash", files=[("w.png", solid((9, 9, 9)))], notify="ftp://example.com/x")
    assert refused.value.status == 422
