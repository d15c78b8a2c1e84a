"""A bulk job's and a schedule's nightly options at the API: `source.case_sensitive` (globs
match in any case unless asked) and `retry_failed` (a pipeline's run processes its known
failures again), each echoed back; `retry_failed` without a pipeline is a 422 sentence."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db.models import Ingest
from kiln.app.tenants.tenants import allow_bucket
from tests.app.api.conftest import TestClient

SOURCE = {"s3": "s3://photos/2026/", "include": ["*.jpg"]}


@pytest.fixture(autouse=True)
def photos_allowed(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        allow_bucket(session, "acme", "photos")
        session.commit()


def test_a_bulk_job_s_globs_match_in_any_case_unless_asked(client: TestClient) -> None:
    default = client.post("/v1/jobs", json={"model": "phash", "source": SOURCE})
    assert default.status_code == 202, default.text
    assert default.json()["source"]["case_sensitive"] is False
    assert default.json()["counts"]["excluded"] == 0
    strict = {**SOURCE, "case_sensitive": True}
    asked = client.post("/v1/jobs", json={"model": "phash", "source": strict})
    assert asked.json()["source"]["case_sensitive"] is True


def test_a_pipeline_s_run_may_retry_its_known_failures(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    body = {"model": "phash", "source": SOURCE, "pipeline": "nightly", "retry_failed": True}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    assert response.json()["counts"]["known_failed"] == 0
    with sessions() as session:
        ingest = session.get(Ingest, response.json()["id"])
        assert ingest is not None and ingest.retry_failed


@pytest.mark.parametrize(
    "body",
    [
        {"model": "phash", "source": SOURCE, "retry_failed": True},
        {"model": "phash", "inputs": [{"uri": "s3://photos/a.jpg"}], "retry_failed": True},
    ],
)
def test_retry_failed_without_a_pipeline_is_422(client: TestClient, body: dict[str, Any]) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    assert '"retry_failed" goes with a "pipeline"' in response.json()["detail"]


def test_a_schedule_keeps_its_retry_failed_and_case_sensitivity(client: TestClient) -> None:
    body = {
        "name": "nightly",
        "cron": "0 2 * * *",
        "model": "phash",
        "source": {**SOURCE, "case_sensitive": True},
        "retry_failed": True,
    }
    created = client.post("/v1/schedules", json=body)
    assert created.status_code == 201, created.text
    got = client.get("/v1/schedules/nightly").json()
    assert got["retry_failed"] is True and got["source"]["case_sensitive"] is True
    plain = client.post("/v1/schedules", json={**body, "name": "plain", "retry_failed": False})
    assert plain.json()["retry_failed"] is False
