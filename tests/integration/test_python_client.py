"""kiln.Client against the real stack (`kiln api`, a worker, Postgres, Redis, moto S3): what the
README's examples do not show — an item's failure sentence, the same key answering the same
job, shards that add up to the one file, URIs, a download, and the sentence of a refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import kiln
from devstack.images import solid
from tests.stack import SOURCE_BUCKET, _key


@pytest.fixture(scope="module")
def py(api_url: str, worker: object, sessions: object) -> Iterator[kiln.Client]:
    with kiln.Client(api_url, _key(sessions, "pyclient")) as client:
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
