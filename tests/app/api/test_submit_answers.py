"""What a submit answers, at every door: a model version that does not exist is a 422 naming
the versions there are; a video's job says it is being expanded; numbers are echoed as given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from devstack.images import solid
from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from tests import videos
from tests.app.api.conftest import TestClient
from tests.app.api.test_models import SPEC, register
from tests.models import colour_classifier

OCR_7 = "Model 'ocr' has no version 7; built-in models have no versions: use 'ocr'."
PHASH_99 = "Model 'phash' has no version 99; built-in models have no versions: use 'phash'."
FPS = "video_fps must be between 0 (every frame) and 1000 frames per second, not {}."


def refused(response: Any, status: int = 422) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["detail"])


def upload(client: TestClient, model: str, **form: str) -> Any:
    files = [("files", ("red.png", solid((230, 20, 20)), "image/png"))]
    return client.post("/v1/jobs", data={"model": model, **form}, files=files)


# --- versions ---------------------------------------------------------------------------------


def test_a_version_of_a_built_in_model_is_refused_at_every_door(client: TestClient) -> None:
    uri = {"inputs": [{"uri": "s3://photos/a.jpg"}]}
    assert refused(client.post("/v1/jobs", json={"model": "ocr:7", **uri})) == OCR_7
    assert refused(upload(client, "phash:99")) == PHASH_99
    bulk = {"model": "phash:99", "source": {"s3": "s3://photos/2026/"}}
    assert refused(client.post("/v1/jobs", json=bulk)) == PHASH_99
    schedule = {"name": "nightly", "cron": "0 2 * * *", **bulk}
    assert refused(client.post("/v1/schedules", json=schedule)) == PHASH_99
    fallback = {"model": "ocr", **uri, "options": {"fallback": {"model": "phash:99"}}}
    assert refused(client.post("/v1/jobs", json=fallback)) == (
        f"The fallback of model 'ocr' is not a model you can use. {PHASH_99}"
    )
    assert refused(client.get("/v1/models/ocr:7"), 404) == OCR_7
    assert client.get("/v1/models/ocr").json()["versions"] == []
    assert upload(client, "phash").status_code == 202  # the built-in by its name


def test_a_registered_version_that_does_not_exist_names_those_there_are(
    client: TestClient, other: dict[str, str], tmp_path: Path
) -> None:
    colour_classifier(tmp_path / "colours.onnx")
    onnx = (tmp_path / "colours.onnx").read_bytes()
    assert register(client, onnx).status_code == 201
    assert refused(upload(client, "colours:2")) == (
        "Model 'colours' has version 1; there is no version 2."
    )
    assert register(client, onnx, spec={**SPEC, "top_k": 1}).status_code == 201
    assert refused(upload(client, "colours:7")) == (
        "Model 'colours' has versions 1, 2; there is no version 7."
    )
    assert upload(client, "colours:2").json()["model"] == "colours:2"
    # another tenant's model is no model at all, in any version: nothing leaks
    files = [("files", ("a.png", solid((1, 2, 3)), "image/png"))]
    theirs = refused(
        client.post("/v1/jobs", data={"model": "colours:1"}, headers=other, files=files)
    )
    assert theirs.startswith("There is no model named 'colours'; available models:")


def test_kiln_run_refuses_a_version_of_a_built_in(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    (tmp_path / "red.png").write_bytes(solid((230, 20, 20)))
    done = CliRunner().invoke(app, ["run", str(tmp_path / "red.png"), "--model", "ocr:7"])
    assert done.exit_code == 1, done.output
    assert OCR_7 in " ".join(done.output.split())


# --- a video's job says it is being expanded -----------------------------------------------------


def test_a_video_not_yet_expanded_is_counted_as_expanding(
    client: TestClient, tmp_path: Path
) -> None:
    """Until a worker reads a video and adds its frames, the job's answer says so: `total`
    counts the video as one item and will grow by its frames."""
    clip = videos.plain(tmp_path / "clip.mp4", 20, fps=10).read_bytes()
    files = [
        ("files", ("clip.mp4", clip, "video/mp4")),
        ("files", ("red.png", solid((230, 20, 20)), "image/png")),
    ]
    answer = client.post("/v1/jobs", data={"model": "phash", "video_fps": "500"}, files=files)
    assert answer.status_code == 202, answer.text
    counts = answer.json()["counts"]
    assert (counts["total"], counts["expanding"]) == (2, 1)
    job_id = answer.json()["id"]
    assert client.get(f"/v1/jobs/{job_id}").json()["counts"]["expanding"] == 1
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert client.get(f"/v1/jobs/{job_id}").json()["counts"]["expanding"] == 0

    images = upload(client, "phash")
    assert images.json()["counts"]["expanding"] == 0


# --- numbers echoed as given --------------------------------------------------------------------


@pytest.mark.parametrize(("given", "echoed"), [("-1", "-1"), ("5000", "5000"), ("-0.5", "-0.5")])
def test_video_fps_is_echoed_as_given(client: TestClient, given: str, echoed: str) -> None:
    body = {"model": "phash", "inputs": [{"uri": "s3://photos/a.jpg"}]}
    as_json = client.post(
        "/v1/jobs", content=f'{json.dumps(body)[:-1]}, "video_fps": {given}}}',
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert refused(as_json) == FPS.format(echoed)
    as_option = client.post(
        "/v1/jobs", content=f'{json.dumps(body)[:-1]}, "options": {{"video_fps": {given}}}}}',
        headers={"content-type": "application/json"},
    )  # fmt: skip
    assert refused(as_option) == FPS.format(echoed)
    assert refused(upload(client, "phash", video_fps=given)) == FPS.format(echoed)


def test_a_registered_spec_echoes_its_numbers_as_given(client: TestClient, tmp_path: Path) -> None:
    colour_classifier(tmp_path / "colours.onnx")
    onnx = (tmp_path / "colours.onnx").read_bytes()
    detail = refused(register(client, onnx, spec={**SPEC, "refuse_below": -1}))
    assert detail.endswith("softmax probability), not -1.")


def test_kiln_s_progress_says_videos_are_being_expanded() -> None:
    from kiln.app.cli.remote import _eta

    assert _eta({"counts": {"expanding": 2}}) == "expanding 2 videos into frames…"
    one = {"counts": {"expanding": 1}, "eta_seconds": 65}
    assert _eta(one) == "expanding 1 video into frames… ETA 1:05"
    assert _eta({"counts": {"expanding": 0}, "eta_seconds": 65}) == "ETA 1:05"
    assert _eta({"counts": {"expanding": None}}) == ""  # not counted


def test_the_cli_sends_a_whole_video_fps_as_an_int() -> None:
    """`--video-fps 5000` is echoed back as 5000, as it was typed."""
    from kiln.app.cli.common import with_video_fps

    sent = with_video_fps({}, 5000.0)["video_fps"]
    assert sent == 5000 and isinstance(sent, int)
    assert with_video_fps({}, 0.5) == {"video_fps": 0.5}
    assert with_video_fps({"a": 1}, None) == {"a": 1}
