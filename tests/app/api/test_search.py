"""POST /v1/jobs/{id}/search and GET /v1/jobs/{id}/thumbnail on the embedded defaults (SQLite,
a local store, the filesystem broker). Where a job must run — the searched one, and the query
job an image search submits — a real Celery worker runs in a thread of this process, as
`kiln run` does, with a tiny real image embedder (`tests.models.thumbnail_embedder`)."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from devstack.images import near_copy, photo
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.results.vector_index import INDEX, KEYS
from kiln.app.storage.local import LocalStore
from kiln.workers.celery.app import make_celery
from kiln.workers.embedded import embedded_worker
from tests.app.api.conftest import TestClient
from tests.app.api.test_routes import assert_sentence, submit
from tests.models import register_thumbnail_embedder

PHOTOS = {f"p{i}.jpg": photo(300 + i) for i in range(3)}
COPIES = {f"p{i}-small.jpg": near_copy(data) for i, data in enumerate(PHOTOS.values())}


@pytest.fixture
def worker(settings: Settings) -> Iterator[None]:
    """A Celery worker on a thread, consuming the test's filesystem broker."""
    with embedded_worker(make_celery(settings), concurrency=2):
        yield


def run_job(
    client: TestClient, store: LocalStore, model: str, images: dict[str, bytes], **options: Any
) -> str:
    parts = [("files", (name, data, "image/jpeg")) for name, data in images.items()]
    form = {"model": model, "options": json.dumps(options)}
    response = client.post("/v1/jobs", data=form, files=parts)
    assert response.status_code == 202, response.text
    job = finished(client, store, response.json()["id"])
    assert job["status"] == "completed" and job["counts"]["succeeded"] == len(images), job
    return str(job["id"])


def finished(client: TestClient, store: LocalStore, job_id: str) -> dict[str, Any]:
    """The job once closed and its close steps (the index among them) done: its manifest is
    their last write."""
    job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", params={"wait": 60}).json()
    deadline = time.monotonic() + 30
    while not store.exists(f"results/{job_id}/manifest.json") and time.monotonic() < deadline:
        time.sleep(0.05)
    return job


def search_image(client: TestClient, job_id: str, data: bytes, **form: Any) -> Any:
    upload = [("file", ("query.jpg", data, "image/jpeg"))]
    return client.post(f"/v1/jobs/{job_id}/search", data=form, files=upload)


def text_job(client: TestClient) -> str:
    response = client.post(
        "/v1/jobs", json={"model": "text-embed", "inputs": [{"text": "A man eats bread."}]}
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


@pytest.fixture
def closed_job(client: TestClient, store: LocalStore, tmp_path: Path, worker: None) -> str:
    """A completed image embedding job: three photos and a resized copy of each."""
    return run_job(
        client,
        store,
        register_thumbnail_embedder(client, tmp_path, "thumbs"),
        PHOTOS | COPIES,
        group={},
    )


def test_search_by_image_through_a_query_job(client: TestClient, closed_job: str) -> None:
    response = search_image(client, closed_job, near_copy(PHOTOS["p1.jpg"], 0.9, 60), k=3)
    assert response.status_code == 200, response.text
    found = response.json()
    assert (found["job_id"], found["query"]) == (closed_job, "image")
    keys = [hit["key"] for hit in found["hits"]]
    assert len(keys) == 3 and set(keys[:2]) == {"p1.jpg", "p1-small.jpg"}
    similarities = [hit["similarity"] for hit in found["hits"]]
    assert similarities == sorted(similarities, reverse=True) and similarities[0] > 0.95
    query = client.get(f"/v1/jobs/{found['query_job_id']}/items").json()["items"]
    assert [(i["key"], i["status"]) for i in query] == [(f"search:{closed_job}", "succeeded")]

    thumb = client.get(found["hits"][0]["thumbnail_url"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"
    with Image.open(io.BytesIO(thumb.content)) as image:
        assert image.format == "JPEG" and max(image.size) == 256  # the original is 640 wide


def test_search_by_key_answers_the_look_alikes(client: TestClient, closed_job: str) -> None:
    response = client.post(f"/v1/jobs/{closed_job}/search", json={"key": "p2.jpg", "k": 2})
    assert response.status_code == 200, response.text
    found = response.json()
    assert found["query"] == "key" and found["query_job_id"] is None
    keys = [hit["key"] for hit in found["hits"]]
    assert keys[0] == "p2-small.jpg" and "p2.jpg" not in keys  # itself left out
    assert len(found["hits"]) == 2 and all(h["thumbnail_url"] for h in found["hits"])
    missing = client.post(f"/v1/jobs/{closed_job}/search", json={"key": "nope.jpg"})
    assert_sentence(missing, 404, "no item 'nope.jpg'")


def test_another_tenant_gets_404(client: TestClient, other: dict[str, str]) -> None:
    job_id = submit(client, n=1)["id"]
    search = client.post(f"/v1/jobs/{job_id}/search", json={"key": "f0.png"}, headers=other)
    assert_sentence(search, 404, f"no job {job_id}")
    thumb = client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "f0.png"}, headers=other)
    assert_sentence(thumb, 404, f"no job {job_id}")
    assert client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "f0.png"}).status_code == 200


def test_a_running_job_is_409(client: TestClient) -> None:
    job_id = text_job(client)  # no worker runs: it stays queued
    response = client.post(f"/v1/jobs/{job_id}/search", json={"text": "bread"})
    assert_sentence(response, 409, "still queued", "once it closes")


@pytest.mark.parametrize("k", [0, 101, -3])
def test_a_k_out_of_bounds_is_422(client: TestClient, k: int) -> None:
    job_id = text_job(client)
    response = client.post(f"/v1/jobs/{job_id}/search", json={"text": "bread", "k": k})
    assert_sentence(response, 422, "from 1 to 100")


def test_a_k_that_is_no_number_is_422(client: TestClient) -> None:
    response = search_image(client, text_job(client), photo(1), k="many")
    assert_sentence(response, 422, "k must be a whole number")


def test_the_wrong_kind_of_query_is_422(client: TestClient, tmp_path: Path) -> None:
    texts = text_job(client)
    assert_sentence(search_image(client, texts, photo(1)), 422, "embeds text", "not an image")
    parts = [("files", ("a.jpg", photo(2), "image/jpeg"))]
    model = register_thumbnail_embedder(client, tmp_path, "thumbs")
    images = client.post("/v1/jobs", data={"model": model}, files=parts).json()["id"]
    response = client.post(f"/v1/jobs/{images}/search", json={"text": "a red car"})
    assert_sentence(response, 422, "embeds images", "not a text")
    detector = submit(client, n=1)["id"]
    response = client.post(f"/v1/jobs/{detector}/search", json={"key": "f0.png"})
    assert_sentence(response, 422, "a detect model", "only the jobs of an embedding model")


@pytest.mark.parametrize(
    "body", [{}, {"text": "a", "key": "b"}, {"key": "b", "extra": 1}], ids=["none", "both", "extra"]
)
def test_a_search_needs_one_query(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post(f"/v1/jobs/{text_job(client)}/search", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"].endswith(".")


def test_a_form_without_a_file_is_422(client: TestClient) -> None:
    response = client.post(f"/v1/jobs/{text_job(client)}/search", data={"k": "3"}, files={})
    assert_sentence(response, 422)


def test_a_job_closed_before_indexes_existed_is_409(
    client: TestClient, closed_job: str, store: LocalStore
) -> None:
    for name in (INDEX, KEYS):
        store.delete(f"results/{closed_job}/{name}")
    response = client.post(f"/v1/jobs/{closed_job}/search", json={"key": "p0.jpg"})
    assert_sentence(response, 409, "no vector index", "closed before")


def test_a_job_whose_items_all_failed_finds_nothing(
    client: TestClient, store: LocalStore, tmp_path: Path, worker: None
) -> None:
    model = register_thumbnail_embedder(client, tmp_path, "thumbs")
    parts = [("files", ("bad.jpg", b"not a picture", "image/jpeg"))]
    job_id = client.post("/v1/jobs", data={"model": model}, files=parts).json()["id"]
    job = finished(client, store, job_id)
    assert job["status"] == "completed" and job["counts"]["failed"] == 1
    response = search_image(client, job_id, photo(5))
    assert response.status_code == 200 and response.json()["hits"] == []
    assert_sentence(
        client.post(f"/v1/jobs/{job_id}/search", json={"key": "bad.jpg"}), 404, "no item"
    )


def test_no_worker_to_embed_the_query_is_503(
    client: TestClient, settings: Settings, closed_job: str, tmp_path: Path
) -> None:
    # The same database and store, but a broker folder no worker reads, and a short wait.
    quiet = settings.model_copy(update={"data_dir": tmp_path / "quiet", "search_wait_s": 0.5})
    with TestClient(create_app(quiet), headers=dict(client.headers)) as api:
        response = search_image(api, closed_job, photo(300))
        detail = assert_sentence(response, 503, "No worker embedded the search query within 0.5 s")
        assert response.headers["Retry-After"]
        newest = api.get("/v1/jobs", params={"limit": 1}).json()["jobs"][0]
    assert newest["id"] in detail and newest["status"] == "cancelled"  # no one waits for it


def test_thumbnails(client: TestClient) -> None:
    job_id = submit(client, n=2)["id"]
    response = client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "f1.png"})
    assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
    with Image.open(io.BytesIO(response.content)) as image:
        assert image.size == (64, 48)  # smaller than the cap: not enlarged
    missing = client.get(f"/v1/jobs/{job_id}/thumbnail", params={"key": "nope.png"})
    assert_sentence(missing, 404, "no item 'nope.png'")
    texts = text_job(client)
    response = client.get(f"/v1/jobs/{texts}/thumbnail", params={"key": "text-0"})
    assert_sentence(response, 422, "text model")


def test_the_routes_need_a_key_and_are_documented(client: TestClient) -> None:
    client.headers.pop("Authorization")
    job = "00000000-0000-0000-0000-000000000000"
    assert client.post(f"/v1/jobs/{job}/search", json={"key": "a"}).status_code == 401
    assert client.get(f"/v1/jobs/{job}/thumbnail", params={"key": "a"}).status_code == 401
    paths = client.get("/openapi.json").json()["paths"]
    body = paths["/v1/jobs/{job_id}/search"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    assert (
        "image/jpeg" in paths["/v1/jobs/{job_id}/thumbnail"]["get"]["responses"]["200"]["content"]
    )
