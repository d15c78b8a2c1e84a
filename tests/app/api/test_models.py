"""/v1/models: registering versioned ONNX models per tenant, and reading them back."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.catalog.catalog import get_model
from kiln.app.core.config import Settings
from kiln.app.db import queries
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models import detect
from kiln.workers.models.direct import run_direct
from kiln.workers.models.loader import load_predictor, output_fields
from tests.app.api.conftest import TestClient
from tests.models import colour_classifier
from tests.workers.models.yolo import LABELS as YOLO_LABELS
from tests.workers.models.yolo import tiny_yolo

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


# ---------------------------------------------------------------- detectors


@pytest.fixture
def yolo_bytes(tmp_path: Path) -> bytes:
    return tiny_yolo(tmp_path / "yolo.onnx").read_bytes()


DETECT_SPEC = {"input_size": 32, "labels": YOLO_LABELS}


def red_png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (255, 0, 0)).save(buffer, "PNG")
    return buffer.getvalue()


def test_a_registered_detector_runs_with_its_labels(
    client: TestClient,
    yolo_bytes: bytes,
    settings: Settings,
    store: LocalStore,
    sessions: sessionmaker[Session],
) -> None:
    """Registered over HTTP, then loaded as a worker loads it: the stored ONNX, fed as the
    stored spec says (letterboxed, 0–1, mean 0 and std 1), boxes in image pixels."""
    response = register(client, yolo_bytes, "boxes", spec=DETECT_SPEC, kind="detect")
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["kind"], body["ref"], body["spec"]["fit"]) == ("detect", "boxes:1", "letterbox")
    assert (body["spec"]["score_threshold"], body["spec"]["max_boxes"]) == (0.25, 300)
    with sessions() as session:
        info = get_model(session, "boxes", "acme")
    assert output_fields(info) == detect.FIELDS
    pipeline = load_predictor(info, EngineFactory(settings, store))
    assert run_direct(pipeline, [red_png((64, 48))]) == [
        {"detections": [{"label": "red", "score": 0.75, "box": [8.0, 8.0, 24.0, 24.0]}]}
    ]


def test_a_detector_can_be_named_by_a_job(client: TestClient, yolo_bytes: bytes) -> None:
    register(client, yolo_bytes, "boxes", spec=DETECT_SPEC, kind="detect")
    files = [("files", ("a.png", red_png((8, 8)), "image/png"))]
    job = client.post("/v1/jobs", data={"model": "boxes"}, files=files)
    assert job.status_code == 202 and job.json()["model"] == "boxes:1"


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"labels": ["a", "b", "c"]}, "6 values per anchor (4 for the box, 2 class scores), but 3"),
        ({"labels": []}, "A detector needs labels"),
        ({"input_size": 64}, "The model's input is 32 pixels a side, but input_size is 64;"),
        ({"layout": "NHWC"}, "laid out NCHW, but the spec's layout is NHWC."),
        ({"fit": "crop"}, "its fit must be letterbox or squash"),
        ({"score_threshold": 2}, "score_threshold"),
        ({"max_boxes": 0}, "max_boxes"),
        ({"resize_filter": "box"}, "resize_filter"),
        ({"channel_order": "GBR"}, "channel_order"),
        ({"mean": [123.675, 116.28, 103.53]}, "on the 0-255 scale, but pixel_range is 0-1"),
    ],
)
def test_a_detector_spec_that_does_not_fit_is_a_422(
    client: TestClient, yolo_bytes: bytes, change: dict[str, Any], sentence: str
) -> None:
    response = register(client, yolo_bytes, "boxes", spec={**DETECT_SPEC, **change}, kind="detect")
    assert response.status_code == 422
    assert sentence in response.json()["detail"]


def test_a_classifier_registered_as_a_detector_is_a_422(
    client: TestClient, onnx_bytes: bytes
) -> None:
    response = register(client, onnx_bytes, "boxes", spec=DETECT_SPEC, kind="detect")
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "A detector must output [N, 4 + classes, anchors] (YOLOv8 style); "
        "the model's output shape is [?, 4]."
    )


def test_detector_settings_on_a_classifier_are_a_422(client: TestClient, onnx_bytes: bytes) -> None:
    response = register(client, onnx_bytes, spec={**SPEC, "iou_threshold": 0.5})
    assert response.status_code == 422
    assert "are for detect models" in response.json()["detail"]


def test_a_classifier_declares_clip_style_preprocessing(
    client: TestClient, onnx_bytes: bytes
) -> None:
    declared = {"resize_filter": "bicubic", "crop_ratio": 1.0, "channel_order": "BGR"}
    response = register(client, onnx_bytes, spec={**SPEC, **declared})
    assert response.status_code == 201, response.text
    assert declared.items() <= response.json()["spec"].items()
    assert response.json()["spec"]["fit"] == "crop"


def test_json_registration_takes_a_detector(client: TestClient) -> None:
    """The JSON body accepts kind detect and its settings (the source is what is refused)."""
    spec = {**DETECT_SPEC, "fit": "squash", "max_boxes": 10}
    body = {"name": "x", "kind": "detect", "source": "/etc/model.onnx", "spec": spec}
    response = client.post("/v1/models", json=body)
    assert response.status_code == 422 and "s3://" in response.json()["detail"]


def test_an_unknown_kind_in_the_form_names_the_kinds(client: TestClient, yolo_bytes: bytes) -> None:
    response = register(client, yolo_bytes, "boxes", spec=DETECT_SPEC, kind="segment")
    assert response.status_code == 422
    assert response.json()["detail"] == (
        "The form needs 'name' and 'kind' (one of detect, classify, embed)."
    )
