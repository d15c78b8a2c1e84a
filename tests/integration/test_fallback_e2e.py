"""A fallback job on the real stack (API → Redis → Celery worker → Postgres + S3): a classifier
with a confidence floor refuses the ambiguous images, its fallback answers them, and every
input ends with an answer and the model that gave it."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq

from devstack.images import solid
from tests.integration.test_bulk import manifest_of
from tests.integration.test_http_jobs import wait_done
from tests.integration.test_models_e2e import COLOURS, items, register

LABELS = {**COLOURS, "labels": ["red", "green", "blue", "dark"], "top_k": 1}
FILES = {
    "red.png": solid((240, 10, 10)),
    "green.png": solid((10, 240, 10)),
    "grey.png": solid((128, 128, 128)),  # red, green and blue alike: a third each
    "teal.png": solid((10, 128, 128)),  # green and blue alike: a half each, under 0.6
}


def submit(client: httpx.Client, model: str, options: dict[str, Any]) -> httpx.Response:
    parts = [("files", (name, data, "image/png")) for name, data in FILES.items()]
    return client.post(
        "/v1/jobs", data={"model": model, "options": json.dumps(options)}, files=parts
    )


def test_a_fallback_job_answers_every_input(
    client: httpx.Client, other_client: httpx.Client, s3: Any, settings: Any, tmp_path: Path
) -> None:
    strict = register(client, tmp_path, "e2e-strict", "classify", {**LABELS, "refuse_below": 0.6})
    lenient = register(client, tmp_path, "e2e-lenient", "classify", LABELS)
    options = {"fallback": {"model": "e2e-lenient", "on": ["refused"]}}

    response = submit(client, strict, options)
    assert response.status_code == 202, response.text
    job = wait_done(client, response.json()["id"], timeout=240)

    assert job["status"] == "completed", job
    counts = job["counts"]
    assert (counts["total"], counts["succeeded"], counts["failed"]) == (4, 4, 0)
    assert (counts["fell_back"], counts["fell_back_succeeded"]) == (2, 2)
    rows = items(client, job)
    assert {key: row["answered_by"] for key, row in rows.items()} == {
        "red.png": strict,
        "green.png": strict,
        "grey.png": lenient,
        "teal.png": lenient,
    }
    assert rows["grey.png"]["fallback_reason"] == (
        "Refused: the top score 0.3333 is below the model's floor 0.6."
    )
    assert rows["red.png"]["fallback_reason"] is None
    assert rows["teal.png"]["outputs"]["labels"][0]["label"] in ("green", "blue")

    table = pq.read_table(io.BytesIO(client.get(job["results_url"]).content)).to_pylist()
    by_key = {row["key"]: row for row in table}
    assert {k: r["answered_by"] for k, r in by_key.items()} == {
        k: r["answered_by"] for k, r in rows.items()
    }
    assert by_key["teal.png"]["fallback_reason"].startswith("Refused: the top score 0.")
    assert by_key["grey.png"]["labels"][0]["score"] > 0.3  # the fallback's own answer

    manifest = manifest_of(s3, settings, job["id"])
    assert manifest["fallback"] == {"model": lenient, "on": ["refused"]}
    assert (manifest["counts"]["fell_back"], manifest["counts"]["fell_back_succeeded"]) == (2, 2)

    # Another tenant cannot name acme's model as its fallback: it does not exist for globex.
    refused = submit(other_client, "detector", options)
    assert refused.status_code == 422
    assert "not a model you can use" in refused.json()["detail"]
