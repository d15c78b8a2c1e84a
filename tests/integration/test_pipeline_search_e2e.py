"""A pipeline's library searched on the real stack (API and worker processes, Postgres, Redis,
S3): an incremental embedding pipeline's rerun adds its new pictures to the library's vector
index, so `POST /v1/pipelines/{name}/search` and `kiln search --pipeline` find a new picture's
original from the earlier run, and its groups join them."""

from __future__ import annotations

import io
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from devstack.images import near_copy, photo
from tests.integration.test_search_e2e import cropped, finished
from tests.models import register_thumbnail_embedder
from tests.stack import SOURCE_BUCKET, _key, run_kiln

PREFIX = "search-library/"
ORIGINALS = {f"{PREFIX}o{i}.jpg": photo(800 + i) for i in range(4)}
# what lands in the bucket before the rerun: copies of two originals, and a new picture
NEW = {
    f"{PREFIX}o1-small.jpg": near_copy(ORIGINALS[f"{PREFIX}o1.jpg"]),
    f"{PREFIX}o2-crop.jpg": cropped(ORIGINALS[f"{PREFIX}o2.jpg"]),
    f"{PREFIX}n.jpg": photo(899),
}


def run_pipeline(client: httpx.Client, model: str) -> dict[str, Any]:
    body = {
        "model": model,
        "source": {"s3": f"s3://{SOURCE_BUCKET}/{PREFIX}", "include": ["*.jpg"]},
        "pipeline": "photos",
        "options": {"group": {}},
    }
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job = finished(client, response.json()["id"])
    assert job["status"] == "completed", job
    return job


def put(s3: Any, objects: dict[str, bytes]) -> None:
    for key, data in objects.items():
        s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=data)


@pytest.fixture(scope="module")
def library(
    client: httpx.Client, s3: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """Two runs of pipeline `photos`: the originals, then only what was added since."""
    model = register_thumbnail_embedder(
        client, tmp_path_factory.mktemp("library"), "e2e-library-thumbs"
    )
    put(s3, ORIGINALS)
    first = run_pipeline(client, model)
    assert first["counts"]["succeeded"] == len(ORIGINALS), first
    put(s3, NEW)
    rerun = run_pipeline(client, model)
    c = rerun["counts"]
    assert (c["succeeded"], c["skipped"]) == (len(NEW), len(ORIGINALS)), rerun
    return {"model": model, "first": first, "rerun": rerun}


def search(client: httpx.Client, **kwargs: Any) -> dict[str, Any]:
    response = client.post("/v1/pipelines/photos/search", **kwargs)
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def test_an_image_finds_its_original_from_an_earlier_run(
    client: httpx.Client, library: dict[str, Any]
) -> None:
    query = near_copy(ORIGINALS[f"{PREFIX}o0.jpg"], 0.7, 50)  # a copy the pipeline never saw
    upload = [("file", ("query.jpg", query, "image/jpeg"))]
    found = search(client, data={"k": "3"}, files=upload)
    assert (found["pipeline"], found["job_id"]) == ("photos", library["rerun"]["id"])
    keys = [hit["key"] for hit in found["hits"]]
    assert f"{PREFIX}o0.jpg" in keys  # processed by the first run only

    thumb = client.get(found["hits"][keys.index(f"{PREFIX}o0.jpg")]["thumbnail_url"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    assert f"/v1/jobs/{library['first']['id']}/" in str(thumb.url)


def test_a_new_pictures_key_finds_its_original(
    client: httpx.Client, library: dict[str, Any]
) -> None:
    for new, original in (("o1-small.jpg", "o1.jpg"), ("o2-crop.jpg", "o2.jpg")):
        found = search(client, json={"key": f"{PREFIX}{new}", "k": 3})
        assert found["hits"][0]["key"] == f"{PREFIX}{original}", found


def test_the_reruns_groups_join_new_copies_with_the_library(
    client: httpx.Client, library: dict[str, Any]
) -> None:
    response = client.get(f"/v1/jobs/{library['rerun']['id']}/groups")
    assert response.status_code == 200, response.text
    rows = pq.read_table(io.BytesIO(response.content)).to_pylist()
    groups: dict[int, set[str]] = {}
    for row in rows:
        groups.setdefault(row["group"], set()).add(row["key"].removeprefix(PREFIX))
    assert {"o1.jpg", "o1-small.jpg"} in groups.values()
    assert {"o2.jpg", "o2-crop.jpg"} in groups.values()


def test_the_cli_searches_a_pipeline(
    service_env: dict[str, str], api_url: str, sessions: object, library: dict[str, Any]
) -> None:
    env = {**service_env, "KILN_API_URL": api_url, "KILN_API_KEY": _key(sessions, "acme")}
    shown = run_kiln(env, "search", "--pipeline", "photos", "--key", f"{PREFIX}o1.jpg", "-k", "2")
    assert shown.returncode == 0, shown.stderr
    assert "2 nearest in pipeline photos" in shown.stdout and "o1-small" in shown.stdout
