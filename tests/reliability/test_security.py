"""Security against the real `kiln api`: tenants are isolated, buckets are allow-listed, revoked
keys stop working, and presigned result URLs work, but only for their key and lifetime.

moto (the stack's S3) serves presigned URLs without checking their signature or expiry, so a
tampered or expired URL is judged by `s3_would_accept`, the SigV4 check S3 itself applies."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from devstack.images import photo
from devstack.jobs import wait_closed
from devstack.services import AWS_ENV
from kiln.app.tenants.auth import revoke_key
from tests.sigv4 import s3_would_accept
from tests.stack import _key, run_kiln

PRIVATE = "kiln-private"  # exists in S3, but no test tenant is allowed to read it


@pytest.fixture(scope="module")
def finished_job(client: httpx.Client) -> str:
    """One small job of tenant `acme`, run to the end (so its manifest exists)."""
    files = [("files", ("a.jpg", photo(seed=7), "image/jpeg"))]
    response = client.post("/v1/jobs", data={"model": "phash"}, files=files)
    assert response.status_code == 202, response.text
    assert wait_closed(client, response.json()["id"], timeout=300)["status"] == "completed"
    return str(response.json()["id"])


@pytest.fixture(scope="module")
def private_bucket(s3: Any) -> str:
    s3.create_bucket(Bucket=PRIVATE)
    return PRIVATE


@pytest.fixture
def schedule(client: httpx.Client) -> Iterator[str]:
    body = {
        "name": "sec-nightly",
        "cron": "0 2 * * *",
        "model": "phash",
        "source": {"s3": "s3://kiln-sources/sec/"},
    }
    assert client.post("/v1/schedules", json=body).status_code == 201
    yield body["name"]
    client.delete(f"/v1/schedules/{body['name']}")


def test_another_tenants_things_answer_404(
    client: httpx.Client, other_client: httpx.Client, finished_job: str, schedule: str
) -> None:
    for path in ("", "/items", "/results", "/results/urls"):
        response = other_client.get(f"/v1/jobs/{finished_job}{path}")
        assert response.status_code == 404, path
        assert response.json()["detail"] == f"There is no job {finished_job}."
    assert other_client.post(f"/v1/jobs/{finished_job}/cancel").status_code == 404
    assert finished_job not in other_client.get("/v1/jobs").text
    assert other_client.get(f"/v1/schedules/{schedule}").status_code == 404
    assert other_client.delete(f"/v1/schedules/{schedule}").status_code == 404
    assert client.get(f"/v1/schedules/{schedule}").status_code == 200  # still there


def test_a_bucket_off_the_list_is_403_until_an_operator_allows_it(
    client: httpx.Client, private_bucket: str, service_env: dict[str, str]
) -> None:
    body = {"model": "phash", "source": {"s3": f"s3://{private_bucket}/photos/"}}
    refused = client.post("/v1/jobs", json=body)
    assert refused.status_code == 403
    assert refused.json()["detail"] == (
        f"Tenant 'acme' may not read bucket '{private_bucket}'; an operator can allow it "
        f"with `kiln tenants allow-bucket acme {private_bucket}`."
    )
    inputs = {"model": "phash", "inputs": [{"uri": f"s3://{private_bucket}/a.jpg"}]}
    assert client.post("/v1/jobs", json=inputs).status_code == 403
    allowed = run_kiln(service_env, "tenants", "allow-bucket", "acme", private_bucket)
    assert allowed.returncode == 0, allowed.stderr
    try:
        accepted = client.post("/v1/jobs", json=body)
        assert accepted.status_code == 202, accepted.text
        job = wait_closed(client, accepted.json()["id"], timeout=300)
        assert job["status"] == "completed"  # an empty prefix
    finally:
        denied = run_kiln(service_env, "tenants", "deny-bucket", "acme", private_bucket)
        assert denied.returncode == 0, denied.stderr
    assert client.post("/v1/jobs", json=body).status_code == 403


def test_a_revoked_key_is_401(api_url: str, sessions: Any) -> None:
    secret = _key(sessions, "soon-gone")
    with httpx.Client(base_url=api_url, headers={"Authorization": f"Bearer {secret}"}) as http:
        assert http.get("/v1/jobs").status_code == 200
        with sessions() as session:
            revoke_key(session, secret.split("_")[1])
            session.commit()
        refused = http.get("/v1/jobs")
    assert refused.status_code == 401
    assert refused.json()["detail"] == "The API key is unknown or revoked."


def test_presigned_urls_download_the_manifest_and_only_as_signed(
    client: httpx.Client, finished_job: str
) -> None:
    signed = client.get(f"/v1/jobs/{finished_job}/results/urls", params={"expires": 60})
    assert signed.status_code == 200, signed.text
    url = signed.json()["manifest"]["url"]
    manifest = httpx.get(url, timeout=30)  # no Kiln key: the URL is the credential
    assert manifest.status_code == 200
    assert manifest.json()["shards"] == [s["key"] for s in signed.json()["shards"]]
    secret = AWS_ENV["AWS_SECRET_ACCESS_KEY"]
    assert s3_would_accept(url, secret)
    tampered = url.replace("manifest.json", "part-000000.parquet")
    assert not s3_would_accept(tampered, secret)
    assert not s3_would_accept(url, secret, now=datetime.now(UTC) + timedelta(seconds=61))
    too_long = client.get(f"/v1/jobs/{finished_job}/results/urls", params={"expires": 7200})
    assert too_long.status_code == 422


def test_kiln_results_urls(
    client: httpx.Client, finished_job: str, api_url: str, service_env: dict[str, str]
) -> None:
    key = client.headers["Authorization"].removeprefix("Bearer ")
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": key}
    done = run_kiln(env, "results", finished_job, "--urls", "--expires", "120")
    assert done.returncode == 0, done.stderr
    [manifest, *_shards] = done.stdout.splitlines()
    assert manifest.startswith(f"results/{finished_job}/manifest.json\t")
    assert "X-Amz-Expires=120" in manifest
