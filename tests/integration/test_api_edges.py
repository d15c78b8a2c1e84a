"""Auth, tenancy and bad requests: every answer a 4xx with a sentence, never a 500."""

from __future__ import annotations

import httpx
import pytest

from devstack.images import photo


def test_no_key_or_a_bad_key_is_401(api_url: str) -> None:
    assert httpx.get(f"{api_url}/v1/jobs").status_code == 401
    response = httpx.get(f"{api_url}/v1/jobs", headers={"Authorization": "Bearer kiln_nope"})
    assert response.status_code == 401
    assert response.json()["detail"] == "The API key is unknown or revoked."


def test_another_tenants_job_is_404(client: httpx.Client, other_client: httpx.Client) -> None:
    job = client.post(
        "/v1/jobs", data={"model": "detector"}, files=[("files", ("a.jpg", photo(1), "image/jpeg"))]
    ).json()
    for method, path in (
        ("GET", f"/v1/jobs/{job['id']}"),
        ("GET", f"/v1/jobs/{job['id']}/items"),
        ("GET", f"/v1/jobs/{job['id']}/results"),
        ("POST", f"/v1/jobs/{job['id']}/cancel"),
    ):
        response = other_client.request(method, path)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["detail"] == f"There is no job {job['id']}."
    assert job["id"] not in {j["id"] for j in other_client.get("/v1/jobs").json()["jobs"]}


@pytest.mark.parametrize(
    ("body", "sentence"),
    [
        ({"model": "nope", "inputs": [{"uri": "s3://b/k.jpg"}]}, "There is no model named 'nope'"),
        ({"model": "detector", "inputs": [{"uri": "http://x/y.jpg"}]}, "is not an S3 URI"),
        ({"model": "detector", "inputs": [{"text": "hello"}]}, "takes images, not text"),
        (
            {"model": "detector", "inputs": [{"uri": "s3://b/k", "text": "x"}]},
            'exactly one of "uri" or "text"',
        ),
        ({"model": "detector", "inputs": []}, "inputs"),
        ({"model": "detector", "inputs": [{"uri": "s3://b/k"}], "colour": "red"}, "colour"),
        (
            {"model": "detector", "inputs": [{"uri": "s3://b/k"}, {"uri": "s3://b/k"}]},
            "share the name",
        ),
    ],
)
def test_bad_json_jobs_are_422(client: httpx.Client, body: dict, sentence: str) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert sentence in response.json()["detail"]


def test_malformed_requests_are_4xx(client: httpx.Client) -> None:
    broken = client.post(
        "/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 422 and "not valid" in broken.json()["detail"]
    no_files = client.post("/v1/jobs", data={"model": "detector"}, files=[("other", ("x", b"1"))])
    assert no_files.status_code == 422 and "files" in no_files.json()["detail"]
    no_model = client.post("/v1/jobs", files=[("files", ("a.jpg", photo(3), "image/jpeg"))])
    assert no_model.status_code == 422 and "'model'" in no_model.json()["detail"]
    wrong_type = client.post("/v1/jobs", content=b"model=x", headers={"Content-Type": "text/plain"})
    assert wrong_type.status_code == 422
    bad_status = client.get("/v1/jobs/x/items", params={"status": "weird"})
    assert bad_status.status_code == 422
    missing = client.get("/v1/jobs/00000000-0000-0000-0000-000000000000")
    assert missing.status_code == 404


# Size limits (413, too many files) are in tests/reliability/test_api_errors.py, against an API
# started with small limits rather than 50 MB uploads.
