"""/v1/models: registering versioned ONNX models per tenant, and reading them back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db import queries
from tests.app.api.conftest import TestClient
from tests.models import colour_classifier

SPEC = {"input_size": 32, "labels": ["red", "green", "blue", "dark"], "mean": [0, 0, 0],
        "std": [1, 1, 1], "top_k": 2}  # fmt: skip


@pytest.fixture
def onnx_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "colours.onnx"
    colour_classifier(path)
    return path.read_bytes()


def register(
    client: TestClient, data: bytes, name: str = "colours", spec: dict[str, Any] = SPEC, **kw: Any
) -> Any:
    form = {"name": name, "kind": kw.get("kind", "classify"), "spec": json.dumps(spec)}
    return client.post(
        "/v1/models", data=form, files=[("file", ("m.onnx", data, "application/octet-stream"))]
    )


def test_register_then_versions(client: TestClient, onnx_bytes: bytes) -> None:
    first = register(client, onnx_bytes)
    assert first.status_code == 201, first.text
    body = first.json()
    assert (body["ref"], body["version"], body["versions"]) == ("colours:1", "1", [1])
    assert first.headers["location"].endswith("/v1/models/colours:1")
    assert body["spec"]["labels"] == SPEC["labels"] and body["sha256"]

    second = register(client, onnx_bytes, spec={**SPEC, "top_k": 1})
    assert second.json()["ref"] == "colours:2"
    assert client.get("/v1/models/colours").json()["ref"] == "colours:2"  # latest
    assert client.get("/v1/models/colours:1").json()["spec"]["top_k"] == 2
    listed = {m["name"]: m for m in client.get("/v1/models").json()}
    assert listed["colours"]["ref"] == "colours:2" and listed["colours"]["versions"] == [1, 2]


def test_a_job_records_the_version_it_ran(client: TestClient, onnx_bytes: bytes) -> None:
    register(client, onnx_bytes)
    files = [("files", ("a.png", onnx_bytes[:0] + b"\x89PNG", "image/png"))]
    job = client.post("/v1/jobs", data={"model": "colours"}, files=files).json()
    assert job["model"] == "colours:1"
    register(client, onnx_bytes)
    pinned = client.post("/v1/jobs", data={"model": "colours:1"}, files=files).json()
    assert pinned["model"] == "colours:1"


def test_models_are_private_to_their_tenant(
    client: TestClient, other: dict[str, str], onnx_bytes: bytes
) -> None:
    register(client, onnx_bytes)
    assert client.get("/v1/models/colours", headers=other).status_code == 404
    names = {m["name"] for m in client.get("/v1/models", headers=other).json()}
    assert "colours" not in names
    files = [("files", ("a.png", b"x", "image/png"))]
    refused = client.post("/v1/jobs", data={"model": "colours"}, files=files, headers=other)
    assert refused.status_code == 422 and "no model named 'colours'" in refused.json()["detail"]


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"labels": ["only-one"]}, "4 outputs but 1 labels"),
        ({"labels": []}, "needs labels"),
        ({"std": [1, 0, 1]}, "must not contain 0"),
        ({"input_size": 2}, "input_size"),
        ({"input_size": 64}, "The model's input is 32 pixels a side, but input_size is 64;"),
        ({"max_batch": 0}, "max_batch"),
        ({"layout": "CHWN"}, "layout"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_a_spec_that_does_not_fit_is_a_422(
    client: TestClient, onnx_bytes: bytes, change: dict[str, Any], sentence: str
) -> None:
    response = register(client, onnx_bytes, spec={**SPEC, **change})
    assert response.status_code == 422
    assert sentence in response.json()["detail"]


def test_not_an_onnx_file_is_a_422(client: TestClient) -> None:
    response = register(client, b"this is not a model")
    assert response.status_code == 422
    assert response.json()["detail"].startswith("The file is not a readable ONNX model")


def test_an_embedder_records_its_dimension(client: TestClient, tmp_path: Path) -> None:
    """The colour classifier's 4 logits double as a 4-d embedding."""
    path = tmp_path / "e.onnx"
    colour_classifier(path)
    spec = {"input_size": 32, "mean": [0, 0, 0], "std": [1, 1, 1], "fp16": True}
    response = register(client, path.read_bytes(), name="colours-embed", spec=spec, kind="embed")
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["dim"] == 4 and response.json()["spec"]["fp16"] is True


@pytest.mark.parametrize("name", ["detector", "ocr"])
def test_a_builtin_name_is_a_conflict(client: TestClient, onnx_bytes: bytes, name: str) -> None:
    response = register(client, onnx_bytes, name=name)
    assert response.status_code == 409 and "built-in" in response.json()["detail"]


@pytest.mark.parametrize("name", ["has space", "x:3", "-dash"])
def test_a_bad_name_is_a_422(client: TestClient, onnx_bytes: bytes, name: str) -> None:
    assert register(client, onnx_bytes, name=name).status_code == 422


def test_json_registration_needs_an_s3_source(client: TestClient) -> None:
    body = {"name": "x", "kind": "classify", "source": "/etc/model.onnx", "spec": SPEC}
    response = client.post("/v1/models", json=body)
    assert response.status_code == 422 and "s3://" in response.json()["detail"]


def test_unknown_version_is_404(client: TestClient, onnx_bytes: bytes) -> None:
    register(client, onnx_bytes)
    response = client.get("/v1/models/colours:9")
    assert response.status_code == 404 and "version 9" in response.json()["detail"]


def test_engines_reported_by_workers_are_listed(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        queries.report_engine(
            session, "gpu0@box", "detector", "tensorrt:fp16", "tensorrt imports and 1 GPU", "A10G"
        )
        queries.report_engine(session, "gpu0@box", "detector", "tensorrt:fp16", "again", "A10G")
        session.commit()
    detector = client.get("/v1/models/detector").json()
    assert [(e["node"], e["backend"], e["reason"]) for e in detector["engines"]] == [
        ("gpu0@box", "tensorrt:fp16", "again")
    ]
