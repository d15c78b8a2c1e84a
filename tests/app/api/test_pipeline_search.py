"""POST /v1/pipelines/{name}/search and thumbnails of a chosen size, on the embedded defaults.

No worker runs: a pipeline's runs, their items (uploaded bytes in the store) and its library's
index are written as the ingest and a run's close step leave them; search by key needs no
query job. Image queries through a worker are tests/integration/test_search_e2e.py's."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from devstack.images import photo
from kiln.app.cli.commands import app as cli
from kiln.app.db.models import Item, Job, JobStatus, Pipeline, utcnow
from kiln.app.results.results import library_place, place_for, write_manifest
from kiln.app.results.vector_index import VectorIndex
from kiln.app.sources import in_store
from kiln.app.storage.local import LocalStore
from tests.app.api.conftest import TestClient
from tests.app.api.test_routes import assert_sentence
from tests.models import register_thumbnail_embedder

VECTORS = {"a.jpg": [1.0, 0.0, 0.0], "b.jpg": [0.0, 1.0, 0.0], "a-copy.jpg": [0.97, 0.2, 0.0]}


def no_s3() -> object:
    raise AssertionError("these runs keep their results in Kiln's own store")


def add_run(
    session: Session, store: LocalStore, pipeline: Pipeline, keys: list[str], age_s: int = 0
) -> str:
    """A closed run whose items are uploaded pictures, as an ingest and its chunks leave it."""
    job = Job(
        id=str(uuid.uuid4()),
        tenant=pipeline.tenant,
        model=pipeline.model,
        status=JobStatus.COMPLETED,
        source=pipeline.source,
        pipeline_id=pipeline.id,
        queue="bulk",
        created_at=utcnow() - timedelta(seconds=age_s),
    )
    session.add(job)
    session.flush()
    for i, key in enumerate(keys):
        stored = f"jobs/{job.id}/inputs/{i:06d}"
        store.put(stored, photo(700 + i, (800, 600)))
        session.add(Item(job_id=job.id, key=key, source=in_store(stored), status="succeeded"))
    session.commit()
    write_manifest(place_for(store, job.id, None, no_s3), {"job_id": job.id})
    return job.id


@pytest.fixture
def nightly(
    client: TestClient, sessions: sessionmaker[Session], store: LocalStore, tmp_path: Path
) -> dict[str, str]:
    """Pipeline `nightly` of tenant acme over a registered image embedder: a first run of two
    pictures, a rerun that added a copy of one, and the library's index of all three."""
    model = register_thumbnail_embedder(client, tmp_path, "thumbs")
    with sessions() as session:
        pipeline = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://p/"}, model=model)
        session.add(pipeline)
        session.commit()
        first = add_run(session, store, pipeline, ["a.jpg", "b.jpg"], age_s=60)
        rerun = add_run(session, store, pipeline, ["a-copy.jpg"])
        where = library_place(store, pipeline.id, model)
    vectors = np.asarray(list(VECTORS.values()), np.float32)
    VectorIndex.build(list(VECTORS), vectors).save(where)
    return {"model": model, "first": first, "rerun": rerun, "library": where.prefix}


def test_a_pipeline_is_searched_across_its_runs(
    client: TestClient, nightly: dict[str, str]
) -> None:
    response = client.post("/v1/pipelines/nightly/search", json={"key": "a-copy.jpg", "k": 2})
    assert response.status_code == 200, response.text
    found = response.json()
    assert (found["pipeline"], found["job_id"], found["model"], found["query"]) == (
        "nightly",
        nightly["rerun"],  # its newest closed run: the model version searched
        nightly["model"],
        "key",
    )
    assert [hit["key"] for hit in found["hits"]] == ["a.jpg", "b.jpg"]
    assert found["hits"][0]["similarity"] > 0.97
    # a.jpg was processed by the first run only (the rerun skipped it): its thumbnail is there
    url = found["hits"][0]["thumbnail_url"]
    assert f"/v1/jobs/{nightly['first']}/thumbnail?key=a.jpg" in url
    thumb = client.get(url)
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/jpeg"


def test_pipeline_refusals_each_with_a_sentence(
    client: TestClient, other: dict[str, str], nightly: dict[str, str], store: LocalStore
) -> None:
    theirs = client.post("/v1/pipelines/nightly/search", json={"key": "a.jpg"}, headers=other)
    assert_sentence(theirs, 404, "There is no pipeline 'nightly'")
    unknown = client.post("/v1/pipelines/nope/search", json={"key": "a.jpg"})
    assert_sentence(unknown, 404, "There is no pipeline 'nope'")
    text = client.post("/v1/pipelines/nightly/search", json={"text": "a red car"})
    assert_sentence(text, 422, "embeds images", "not a text")
    bad_k = client.post("/v1/pipelines/nightly/search", json={"key": "a.jpg", "k": 0})
    assert_sentence(bad_k, 422, "from 1 to 100")
    missing = client.post("/v1/pipelines/nightly/search", json={"key": "zzz.jpg"})
    assert_sentence(missing, 404, "Pipeline 'nightly' has no item 'zzz.jpg'")


def test_a_pipeline_with_no_index_yet_is_409(
    client: TestClient, nightly: dict[str, str], store: LocalStore
) -> None:
    for name in ("index.usearch", "index-keys.parquet"):
        store.delete(f"{nightly['library']}{name}")
    gone = client.post("/v1/pipelines/nightly/search", json={"key": "a.jpg"})
    assert_sentence(gone, 409, "no vector index yet")


def test_the_size_of_a_thumbnail_can_be_asked_up_to_a_cap(client: TestClient) -> None:
    parts = [("files", ("big.jpg", photo(9, (1200, 900)), "image/jpeg"))]
    job_id = client.post("/v1/jobs", data={"model": "detector"}, files=parts).json()["id"]
    path = f"/v1/jobs/{job_id}/thumbnail"
    for asked, size in ((None, (256, 192)), (512, (512, 384)), (100, (100, 75))):
        params = {"key": "big.jpg"} | ({"max": str(asked)} if asked else {})
        response = client.get(path, params=params)
        assert response.status_code == 200, response.text
        assert "max-age" in response.headers["cache-control"]
        with Image.open(io.BytesIO(response.content)) as image:
            assert image.size == size
    for refused in ("513", "4000", "2"):
        too_big = client.get(path, params={"key": "big.jpg", "max": refused})
        assert too_big.status_code == 422, too_big.text


def test_the_pipeline_route_needs_a_key_and_is_documented(client: TestClient) -> None:
    client.headers.pop("Authorization")
    assert client.post("/v1/pipelines/x/search", json={"key": "a"}).status_code == 401
    paths = client.get("/openapi.json").json()["paths"]
    body = paths["/v1/pipelines/{name}/search"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    sizes = paths["/v1/jobs/{job_id}/thumbnail"]["get"]["parameters"]
    assert any(p["name"] == "max" for p in sizes)


def test_the_cli_asks_for_a_job_or_a_pipeline() -> None:
    runner = CliRunner()
    env = {"KILN_API_URL": "http://127.0.0.1:9", "KILN_API_KEY": "k"}  # never reached
    neither = runner.invoke(cli, ["search", "--key", "a"], env=env)
    both = runner.invoke(cli, ["search", "JOB", "--pipeline", "p", "--key", "a"], env=env)
    for result in (neither, both):
        assert result.exit_code == 1 and "or --pipeline NAME" in result.output
