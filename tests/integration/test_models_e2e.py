"""Every model family through the HTTP API and a real worker: small outputs in Postgres (the
items endpoint reads them), full outputs in the Parquet results from S3."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow.parquet as pq
from sqlalchemy import func, select

from devstack.images import near_copy, photo, solid, words
from kiln.app.db.models import ContentCache
from tests.integration.test_http_jobs import upload, wait_done
from tests.models import colour_classifier


def run(client: httpx.Client, files: dict[str, bytes], model: str, **kw: Any) -> dict[str, Any]:
    response = upload(client, files, model=model) if not kw else client.post("/v1/jobs", **kw)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=240)
    assert job["status"] == "completed", job
    return job


def items(client: httpx.Client, job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    page = client.get(f"/v1/jobs/{job['id']}/items", params={"limit": 1000}).json()
    return {item["key"]: item for item in page["items"]}


def results(client: httpx.Client, job: dict[str, Any]) -> dict[str, dict[str, Any]]:
    table = pq.read_table(io.BytesIO(client.get(job["results_url"]).content))
    return {row["key"]: row for row in table.to_pylist()}


def register(client: httpx.Client, tmp_path: Path, name: str, kind: str, spec: dict) -> str:
    import json

    path = tmp_path / f"{name}.onnx"
    colour_classifier(path)
    form = {"name": name, "kind": kind, "spec": json.dumps(spec)}
    response = client.post("/v1/models", data=form, files=[("file", ("m.onnx", path.read_bytes()))])
    assert response.status_code == 201, response.text
    return str(response.json()["ref"])


COLOURS = {"input_size": 32, "mean": [0, 0, 0], "std": [1, 1, 1]}


def test_detector(client: httpx.Client) -> None:
    job = run(client, {"p.jpg": photo(11)}, "detector")
    assert isinstance(items(client, job)["p.jpg"]["outputs"]["detections"], list)
    assert "detections" in results(client, job)["p.jpg"]


def test_ocr_reads_words(client: httpx.Client) -> None:
    job = run(client, {"sign.png": words("Kiln reads this")}, "ocr")
    text = items(client, job)["sign.png"]["outputs"]["text"]
    assert "Kiln" in text and "reads" in text
    assert results(client, job)["sign.png"]["lines"]


def test_classify(client: httpx.Client, tmp_path: Path) -> None:
    ref = register(client, tmp_path, "e2e-colours", "classify",
                   {**COLOURS, "labels": ["red", "green", "blue", "dark"], "top_k": 1})  # fmt: skip
    job = run(client, {"r.png": solid((240, 10, 10))}, ref)
    assert job["model"] == "e2e-colours:1"
    assert items(client, job)["r.png"]["outputs"]["labels"][0]["label"] == "red"


def test_embed_vectors_go_to_parquet_not_rows(client: httpx.Client, tmp_path: Path) -> None:
    ref = register(client, tmp_path, "e2e-embed", "embed", {**COLOURS, "fp16": True})
    job = run(client, {"g.png": solid((10, 240, 10)), "b.png": solid((10, 10, 240))}, ref)
    stored = items(client, job)["g.png"]["outputs"]
    assert "embedding" not in stored and stored["dim"] == 4
    rows = results(client, job)
    vectors = {k: np.asarray(r["embedding"], dtype=np.float32) for k, r in rows.items()}
    for vector in vectors.values():
        assert vector.shape == (4,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-2
    assert float(vectors["g.png"] @ vectors["b.png"]) < 0.5  # green and blue point elsewhere


def test_text_embed(client: httpx.Client) -> None:
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]
    job = run(client, {}, "text-embed",
              json={"model": "text-embed", "inputs": [{"text": t} for t in texts]})  # fmt: skip
    stored = items(client, job)
    assert all(
        "embedding" not in i["outputs"] and i["outputs"]["tokens"] > 2 for i in stored.values()
    )
    rows = results(client, job)
    food, bread, sky = (np.asarray(rows[f"text-{i}"]["embedding"]) for i in range(3))
    assert food.shape == (384,)
    assert abs(float(food @ bread) - 0.7553) < 1e-3
    assert float(food @ bread) > float(food @ sky) + 0.3


def test_phash_groups_near_duplicates(client: httpx.Client) -> None:
    a, b = photo(21), photo(22)
    files = {
        "a.jpg": a,
        "a-small.jpg": near_copy(a),
        "b.jpg": b,
        "b-copy.jpg": near_copy(b, 0.9, 60),
        "c.jpg": photo(23),
    }
    job = run(client, files, "phash")
    assert len(items(client, job)["a.jpg"]["outputs"]["phash"]) == 16
    rows = results(client, job)
    group = {k: r["group"] for k, r in rows.items()}
    assert group["a.jpg"] == group["a-small.jpg"] is not None
    assert group["b.jpg"] == group["b-copy.jpg"] is not None
    assert group["a.jpg"] != group["b.jpg"] and group["c.jpg"] is None


def test_the_same_bytes_are_answered_from_the_cache(client: httpx.Client, sessions: Any) -> None:
    data = photo(31)
    first = run(client, {"x.jpg": data}, "detector")
    with sessions() as session:
        before = session.scalar(select(func.count()).select_from(ContentCache))
    second = run(client, {"y.jpg": data}, "detector")
    with sessions() as session:
        after = session.scalar(select(func.count()).select_from(ContentCache))
    assert after == before  # nothing new to remember: the result came from the cache
    assert items(client, first)["x.jpg"]["outputs"] == items(client, second)["y.jpg"]["outputs"]
