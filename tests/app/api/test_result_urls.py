"""GET /v1/jobs/{id}/results/urls: presigned URLs of a job's results, on S3 storage only."""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
import requests
from moto import mock_aws

from devstack.images import solid
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.tenants.tenants import allow_bucket
from tests.app.api.conftest import TestClient, bearer

BUCKET = "kiln-results"


def submit(client: TestClient, headers: dict[str, str] | None = None) -> str:
    files = [("files", ("a.png", solid((1, 2, 3)), "image/png"))]
    response = client.post("/v1/jobs", data={"model": "phash"}, files=files, headers=headers)
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


@pytest.fixture
def s3_client(
    settings: Settings, new_key: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, Any]]:
    """A client for `acme` on an app whose results store is moto's S3, and a boto3 client."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        on_s3 = settings.model_copy(update={"storage_url": f"s3://{BUCKET}/kiln"})
        with TestClient(create_app(on_s3), headers=bearer(new_key("acme"))) as http:
            yield http, s3
    gc.collect()


def test_urls_download_the_manifest_and_shards(s3_client: tuple[TestClient, Any]) -> None:
    client, s3 = s3_client
    job_id = submit(client)
    open_job = client.get(f"/v1/jobs/{job_id}/results/urls").json()
    assert open_job["manifest"] is None and open_job["shards"] == []  # nothing written yet
    folder = f"kiln/results/{job_id}/"
    s3.put_object(Bucket=BUCKET, Key=folder + "part-000000.parquet", Body=b"PAR1")
    s3.put_object(Bucket=BUCKET, Key=folder + "manifest.json", Body=b'{"total": 1}')
    body = client.get(f"/v1/jobs/{job_id}/results/urls", params={"expires": 60}).json()
    assert body["job_id"] == job_id and body["manifest"]["key"].endswith("manifest.json")
    assert "X-Amz-Expires=60" in body["manifest"]["url"]
    assert json.loads(requests.get(body["manifest"]["url"], timeout=10).content) == {"total": 1}
    [shard] = body["shards"]
    assert shard["key"] == f"results/{job_id}/part-000000.parquet"
    assert requests.get(shard["url"], timeout=10).content == b"PAR1"
    default = client.get(f"/v1/jobs/{job_id}/results/urls").json()
    assert "X-Amz-Expires=900" in default["manifest"]["url"]


def test_a_job_with_an_output_prefix_is_signed_in_that_bucket(
    s3_client: tuple[TestClient, Any], sessions: Any
) -> None:
    client, s3 = s3_client
    s3.create_bucket(Bucket="theirs")
    with sessions() as session:
        allow_bucket(session, "acme", "theirs")
        session.commit()
    body = {"model": "phash", "source": {"s3": "s3://theirs/in/"}, "output": "s3://theirs/out"}
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    s3.put_object(Bucket="theirs", Key=f"out/{job_id}/manifest.json", Body=b"{}")
    signed = client.get(f"/v1/jobs/{job_id}/results/urls").json()["manifest"]["url"]
    parts = urlsplit(signed)
    assert "theirs" in parts.netloc + parts.path
    assert parts.path.endswith(f"/out/{job_id}/manifest.json")


@pytest.mark.parametrize("expires", [0, 3601])
def test_expiry_is_one_second_to_an_hour(client: TestClient, expires: int) -> None:
    job_id = submit(client)
    response = client.get(f"/v1/jobs/{job_id}/results/urls", params={"expires": expires})
    assert response.status_code == 422 and "expires" in response.json()["detail"]


def test_a_local_store_answers_409_with_the_way_round(client: TestClient) -> None:
    job_id = submit(client)
    response = client.get(f"/v1/jobs/{job_id}/results/urls")
    assert response.status_code == 409
    assert response.json()["detail"] == (
        f"Presigned URLs need S3 storage; download through /v1/jobs/{job_id}/results."
    )


def test_another_tenants_job_is_404(client: TestClient, other: dict[str, str]) -> None:
    job_id = submit(client)
    response = client.get(f"/v1/jobs/{job_id}/results/urls", headers=other)
    assert response.status_code == 404
