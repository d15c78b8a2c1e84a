"""Find what looks alike, on the real stack (API and worker processes, Postgres, Redis, S3): an
image embedding job over near-duplicates groups them when it closes and builds its vector index;
search by an image (embedded by a query job on the worker), by key, and from the CLI; thumbnails
of uploaded and of s3:// inputs."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from PIL import Image

from devstack.images import near_copy, photo
from tests.integration.test_http_jobs import wait_done
from tests.models import register_thumbnail_embedder
from tests.stack import SOURCE_BUCKET, _key, run_kiln


def cropped(data: bytes, keep: float = 0.9) -> bytes:
    """The centre `keep` of the picture, re-encoded: a near-duplicate that lost its edges."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    dx, dy = int(image.width * (1 - keep) / 2), int(image.height * (1 - keep) / 2)
    out = io.BytesIO()
    image.crop((dx, dy, image.width - dx, image.height - dy)).save(out, "JPEG", quality=85)
    return out.getvalue()


ORIGINALS = {f"o{i}.jpg": photo(500 + i) for i in range(4)}
FAMILIES = {  # each original with its copies: resized, re-encoded, cropped
    name.removesuffix(".jpg"): {
        name: data,
        name.replace(".jpg", "-small.jpg"): near_copy(data),
        name.replace(".jpg", "-q60.jpg"): near_copy(data, 1.0, 60),
        name.replace(".jpg", "-crop.jpg"): cropped(data),
    }
    for name, data in list(ORIGINALS.items())[:3]
}
LONERS = {"o3.jpg": ORIGINALS["o3.jpg"], "x.jpg": photo(599)}


@pytest.fixture(scope="module")
def embedded(client: httpx.Client, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The closed job: three families of near-duplicates and two pictures alone."""
    model = register_thumbnail_embedder(client, tmp_path_factory.mktemp("thumbs"), "e2e-thumbs")
    images = {k: v for family in FAMILIES.values() for k, v in family.items()} | LONERS
    parts = [("files", (name, data, "image/jpeg")) for name, data in images.items()]
    form = {"model": model, "options": json.dumps({"group": {}})}
    response = client.post("/v1/jobs", data=form, files=parts)
    assert response.status_code == 202, response.text
    job = finished(client, response.json()["id"])
    assert job["status"] == "completed" and job["counts"]["succeeded"] == len(images), job
    return {"job": job, "model": model}


def finished(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job once closed and its close steps (groups, the index) done: the manifest is their
    last write, and the presigned listing shows it only once it exists."""
    job = wait_done(client, job_id, timeout=240)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if client.get(f"/v1/jobs/{job_id}/results/urls").json()["manifest"] is not None:
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} closed but wrote no manifest in 60 s")


def families_of(groups: dict[str, int | None]) -> list[set[str]]:
    by_group: dict[int, set[str]] = {}
    for key, group in groups.items():
        if group is not None:
            by_group.setdefault(group, set()).add(key)
    return sorted(by_group.values(), key=min)


def test_near_duplicates_are_grouped_when_the_job_closes(
    client: httpx.Client, embedded: dict[str, Any]
) -> None:
    job_id = embedded["job"]["id"]
    expected = [set(family) for family in FAMILIES.values()]
    groups = pq.read_table(io.BytesIO(client.get(f"/v1/jobs/{job_id}/groups").content))
    rows = groups.to_pylist()
    assert families_of({r["key"]: r["group"] for r in rows}) == expected
    assert all(r["similarity"] >= 0.92 for r in rows)
    results = pq.read_table(io.BytesIO(client.get(embedded["job"]["results_url"]).content))
    in_results = {r["key"]: r["group"] for r in results.to_pylist()}
    assert families_of(in_results) == expected
    assert in_results["o3.jpg"] is None and in_results["x.jpg"] is None


def test_search_by_image_finds_the_original(client: httpx.Client, embedded: dict[str, Any]) -> None:
    job_id = embedded["job"]["id"]
    query = near_copy(ORIGINALS["o1.jpg"], 0.7, 50)  # a copy the job never saw
    upload = [("file", ("query.jpg", query, "image/jpeg"))]
    response = client.post(f"/v1/jobs/{job_id}/search", data={"k": "5"}, files=upload)
    assert response.status_code == 200, response.text
    found = response.json()
    keys = [hit["key"] for hit in found["hits"]]
    assert "o1.jpg" in keys[:3] and set(keys[:4]) == set(FAMILIES["o1"])
    query_job = client.get(f"/v1/jobs/{found['query_job_id']}").json()
    assert query_job["model"] == embedded["model"] and query_job["status"] == "completed"

    thumb = client.get(found["hits"][0]["thumbnail_url"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    with Image.open(io.BytesIO(thumb.content)) as image:
        assert max(image.size) <= 256


def test_search_by_key_and_the_refusals(
    client: httpx.Client, other_client: httpx.Client, embedded: dict[str, Any]
) -> None:
    job_id = embedded["job"]["id"]
    response = client.post(f"/v1/jobs/{job_id}/search", json={"key": "o2-crop.jpg", "k": 3})
    assert response.status_code == 200, response.text
    keys = [hit["key"] for hit in response.json()["hits"]]
    assert set(keys) == set(FAMILIES["o2"]) - {"o2-crop.jpg"}
    elsewhere = other_client.post(f"/v1/jobs/{job_id}/search", json={"key": "o2.jpg"})
    assert elsewhere.status_code == 404 and job_id in elsewhere.json()["detail"]
    text = client.post(f"/v1/jobs/{job_id}/search", json={"text": "a red square"})
    assert text.status_code == 422 and "embeds images" in text.json()["detail"]


def test_the_cli_prints_a_table(
    service_env: dict[str, str],
    api_url: str,
    sessions: object,
    embedded: dict[str, Any],
    tmp_path: Path,
) -> None:
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "acme")}
    image = tmp_path / "query.jpg"
    image.write_bytes(cropped(ORIGINALS["o0.jpg"], 0.85))
    job_id = embedded["job"]["id"]
    by_image = run_kiln(env, "search", job_id, "--image", str(image), "-k", "3", timeout=120)
    assert by_image.returncode == 0, by_image.stderr
    assert "3 nearest" in by_image.stdout and "o0" in by_image.stdout
    by_key = run_kiln(env, "search", job_id, "--key", "x.jpg", "-k", "2")
    assert by_key.returncode == 0 and "2 nearest" in by_key.stdout, by_key.stderr
    both = run_kiln(env, "search", job_id, "--key", "x.jpg", "--text", "a")
    assert both.returncode == 1 and "exactly one of" in both.stderr


def test_thumbnails_of_s3_inputs(client: httpx.Client, s3: Any, embedded: dict[str, Any]) -> None:
    s3.put_object(Bucket=SOURCE_BUCKET, Key="search/big.jpg", Body=photo(42, (1200, 900)))
    uri = f"s3://{SOURCE_BUCKET}/search/big.jpg"
    body = {"model": embedded["model"], "inputs": [{"uri": uri}]}
    job = finished(client, client.post("/v1/jobs", json=body).json()["id"])
    assert job["counts"]["succeeded"] == 1, job
    thumb = client.get(f"/v1/jobs/{job['id']}/thumbnail", params={"key": uri})
    assert thumb.status_code == 200, thumb.text
    with Image.open(io.BytesIO(thumb.content)) as image:
        assert image.size == (256, 192)
