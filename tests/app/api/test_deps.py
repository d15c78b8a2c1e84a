"""Route dependencies: S3 clients come from one lazy factory, built only when a bucket is read."""

from __future__ import annotations

from typing import Any

import pytest

from devstack.images import solid
from kiln.app.api import deps
from kiln.app.core.config import Settings
from tests.app.api.conftest import TestClient


def test_the_s3_factory_builds_a_client_only_when_called(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Settings] = []

    def make(on: Settings) -> str:
        made.append(on)
        return "client"

    monkeypatch.setattr(deps, "make_s3_client", make)
    factory = deps.get_s3(settings)
    assert made == []
    assert factory() == "client" and made == [settings]


def test_results_on_local_storage_build_no_s3_client(client: TestClient) -> None:
    def no_client() -> Any:
        raise AssertionError("an S3 client was built for a job stored locally")

    client.app.dependency_overrides[deps.get_s3] = lambda: no_client  # type: ignore[attr-defined]
    files = [("files", ("a.png", solid((1, 2, 3)), "image/png"))]
    job_id = client.post("/v1/jobs", data={"model": "phash"}, files=files).json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/results")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.apache.parquet"
