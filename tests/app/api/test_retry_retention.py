"""The API's doors to replay and retention on the embedded defaults (no worker: the test ends
jobs itself): `POST /v1/jobs/{id}/retry`, `expires_after`, and what a job's answer says."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.core.config import Settings
from kiln.app.db.models import Job
from kiln.app.storage import open_store
from kiln.workers.jobs import retention as sweeper
from tests.app.api.conftest import TestClient
from tests.app.api.test_routes import assert_sentence
from tests.app.conftest import CHUNK_SIZE
from tests.app.jobs.test_retention import Runtime
from tests.app.jobs.test_retry import end
from tests.support import migrated_settings


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The app tests' settings, with a maximum retention of 30 days."""
    return migrated_settings(
        tmp_path, monkeypatch, chunk_size=CHUNK_SIZE, max_files_per_job=10, retention_max="30d"
    )


def texts(client: TestClient, n: int = 5, **extra: Any) -> dict[str, Any]:
    body = {"model": "text-embed", "inputs": [{"text": f"t{i}"} for i in range(n)], **extra}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    job: dict[str, Any] = response.json()
    return job


def ended(sessions: sessionmaker[Session], job_id: str, failed: list[int]) -> None:
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        end(session, job, failed=failed)


def test_retry_answers_201_with_the_new_job_and_both_name_each_other(
    client: TestClient, other: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    job = texts(client)
    assert_sentence(client.post(f"/v1/jobs/{job['id']}/retry"), 409, "still queued")
    ended(sessions, job["id"], failed=[0, 3])

    answer = client.post(f"/v1/jobs/{job['id']}/retry", headers={"Idempotency-Key": "k1"})
    assert answer.status_code == 201, answer.text
    new = answer.json()
    assert new["retry_of"] == job["id"] and new["counts"]["total"] == 2
    assert new["model"] == job["model"] and answer.headers["Location"].endswith(new["id"])
    assert client.get(f"/v1/jobs/{job['id']}").json()["retries"] == [new["id"]]

    again = client.post(f"/v1/jobs/{job['id']}/retry", json={"idempotency_key": "k1"})
    assert again.status_code == 200 and again.json()["id"] == new["id"]
    assert_sentence(client.post(f"/v1/jobs/{job['id']}/retry", headers=other), 404)
    ended(sessions, new["id"], failed=[])
    assert_sentence(client.post(f"/v1/jobs/{new['id']}/retry"), 409, "no failed items")
    odd = client.post(f"/v1/jobs/{job['id']}/retry", json={"include_everything": True})
    assert_sentence(odd, 422)


@pytest.mark.parametrize("asked", [-1, 0, "-2h", "soon", "400d"])
def test_a_bad_expires_after_is_a_422_with_a_sentence(client: TestClient, asked: object) -> None:
    body = {"model": "text-embed", "inputs": [{"text": "t"}], "expires_after": asked}
    assert_sentence(client.post("/v1/jobs", json=body), 422, "expires_after")


def test_the_answer_says_when_a_job_expires(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    job = texts(client, expires_after="12h")
    assert job["expires_at"] is None and job["expired_at"] is None  # open: not yet known
    ended(sessions, job["id"], failed=[])
    answer = client.get(f"/v1/jobs/{job['id']}").json()
    assert answer["expires_at"] is not None and answer["finished_at"] is not None
    span = datetime.fromisoformat(answer["expires_at"]) - datetime.fromisoformat(
        answer["finished_at"]
    )
    assert span.total_seconds() == 12 * 3600


def test_an_expired_jobs_answer_keeps_its_counts_and_its_results_say_why_they_are_gone(
    client: TestClient, sessions: sessionmaker[Session], settings: Settings
) -> None:
    job = texts(client, expires_after="1h")
    ended(sessions, job["id"], failed=[1])
    runtime = Runtime(settings, sessions, open_store(settings))
    sweeper.sweep(runtime)  # stamps its expiry
    with sessions() as session:
        row = session.get(Job, job["id"])
        assert row is not None and row.finished_at is not None
        row.expires_at = row.finished_at  # an hour later, as far as the sweep can tell
        session.commit()
    assert sweeper.sweep(runtime)["jobs_expired"] == 1

    answer = client.get(f"/v1/jobs/{job['id']}").json()
    assert answer["expired_at"] is not None
    assert (answer["counts"]["total"], answer["counts"]["failed"]) == (5, 1)
    for path in ("results", "groups", "results/urls"):
        assert_sentence(client.get(f"/v1/jobs/{job['id']}/{path}"), 409, "deleted by retention")
    assert_sentence(client.post(f"/v1/jobs/{job['id']}/retry"), 409, "deleted by retention")
    assert client.get(f"/v1/jobs/{job['id']}/items").json()["items"] == []


def test_an_upload_form_s_expires_after_is_kept_and_checked(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    """Files go as a multipart form (`kiln.Client.submit(files=…, expires_after=…)` sends it
    there): its `expires_after` field counts as the JSON body's does."""
    files = [("files", ("a.png", b"not read: no worker here", "image/png"))]
    response = client.post("/v1/jobs", data={"model": "phash", "expires_after": "12h"}, files=files)
    assert response.status_code == 202, response.text
    job = response.json()
    ended(sessions, job["id"], failed=[])
    answer = client.get(f"/v1/jobs/{job['id']}").json()
    span = datetime.fromisoformat(answer["expires_at"]) - datetime.fromisoformat(
        answer["finished_at"]
    )
    assert span.total_seconds() == 12 * 3600
    for asked in ("-2h", "soon", "400d"):
        refused = client.post(
            "/v1/jobs", data={"model": "phash", "expires_after": asked}, files=files
        )
        assert_sentence(refused, 422, "expires_after")
