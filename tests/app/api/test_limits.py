"""Per-tenant limits (429 with Retry-After) and the bucket allow-list (403) at the API."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker

from devstack.images import solid
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings, get_settings
from kiln.app.core.errors import LimitExceededError
from kiln.app.tenants.quotas import TenantLimiter, limiter_storage_url
from kiln.app.tenants.tenants import allow_bucket
from tests.app.api.conftest import TestClient, bearer
from tests.app.api.test_console import csrf, sign_in

Factory = Callable[..., TestClient]


@pytest.fixture
def app_with(settings: Settings, new_key: Callable[[str], str]) -> Iterator[Factory]:
    """Clients for tenant `acme` on an app built with some settings changed."""
    clients: list[TestClient] = []

    def make(**changes: Any) -> TestClient:
        http = TestClient(create_app(settings.model_copy(update=changes)))
        http.headers.update(bearer(new_key("acme")))
        clients.append(http.__enter__())
        return http

    yield make
    for http in clients:
        http.__exit__(None, None, None)
    gc.collect()


def upload(client: TestClient, **extra: Any) -> Any:
    files = [("files", ("a.png", solid((200, 10, 10)), "image/png"))]
    return client.post("/v1/jobs", data={"model": "detector", **extra}, files=files)


def test_over_the_rate_answers_429_with_retry_after(
    app_with: Factory, new_key: Callable[[str], str]
) -> None:
    client = app_with(tenant_rate_limit="3/minute")
    assert [client.get("/v1/jobs").status_code for _ in range(3)] == [200, 200, 200]
    refused = client.get("/v1/jobs")
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert refused.json()["detail"] == (
        "Tenant 'acme' is over its rate of 3 per 1 minute; slow down and retry."
    )
    other = client.get("/v1/jobs", headers=bearer(new_key("globex")))
    assert other.status_code == 200  # each tenant has its own count


def test_health_is_not_rate_limited(app_with: Factory) -> None:
    client = app_with(tenant_rate_limit="1/minute")
    assert {client.get("/healthz").status_code for _ in range(5)} == {200}


def test_a_bad_key_is_refused_before_it_counts(app_with: Factory) -> None:
    client = app_with(tenant_rate_limit="2/minute")
    for _ in range(3):
        assert client.get("/v1/jobs", headers=bearer("kiln_wrong")).status_code == 401
    assert client.get("/v1/jobs").status_code == 200


def test_open_jobs_over_the_quota_answer_429(app_with: Factory) -> None:
    client = app_with(tenant_max_open_jobs=2)
    first = upload(client, idempotency_key="first").json()
    assert upload(client).status_code == 202
    refused = upload(client)
    assert refused.status_code == 429
    assert refused.headers["Retry-After"] == "10"
    assert refused.json()["detail"] == (
        "Tenant 'acme' has 2 open jobs, the most allowed; wait for some to finish."
    )
    retry = upload(client, idempotency_key="first")  # a retry is answered, not refused
    assert retry.status_code == 200 and retry.json()["id"] == first["id"]
    assert client.post(f"/v1/jobs/{first['id']}/cancel").status_code == 200
    assert upload(client).status_code == 202


def test_the_quota_covers_bulk_jobs(app_with: Factory, sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        allow_bucket(session, "acme", "photos")
        session.commit()
    client = app_with(tenant_max_open_jobs=1)
    assert upload(client).status_code == 202
    bulk = client.post("/v1/jobs", json={"model": "phash", "source": {"s3": "s3://photos/"}})
    assert bulk.status_code == 429 and "has 1 open jobs" in bulk.json()["detail"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/jobs", {"model": "detector", "inputs": [{"uri": "s3://photos/a.jpg"}]}),
        ("/v1/jobs", {"model": "phash", "source": {"s3": "s3://photos/2026/"}}),
        ("/v1/schedules", {"name": "n", "cron": "0 2 * * *", "model": "phash",
                           "source": {"s3": "s3://photos/"}}),
        ("/v1/models", {"name": "m", "kind": "classify", "source": "s3://photos/m.onnx",
                        "spec": {"input_size": 32, "labels": ["a", "b"]}}),
    ],
)  # fmt: skip
def test_a_bucket_not_on_the_list_is_403(client: TestClient, path: str, body: Any) -> None:
    response = client.post(path, json=body)
    assert response.status_code == 403, response.text
    assert response.json()["detail"] == (
        "Tenant 'acme' may not read bucket 'photos'; an operator can allow it with "
        "`kiln tenants allow-bucket acme photos`."
    )


def test_the_limiter_fails_open_when_redis_is_down(caplog: pytest.LogCaptureFixture) -> None:
    limiter = TenantLimiter("1/minute", "redis://127.0.0.1:1/0")  # nothing listens on port 1
    with caplog.at_level(logging.WARNING, logger="kiln.app.tenants.quotas"):
        for _ in range(3):
            limiter.hit("acme")  # no 429, no exception
    assert "rate limiter unavailable" in caplog.text
    assert len(caplog.records) == 1  # then it stops trying for a while, and stays quiet


def test_the_api_answers_when_the_limiter_redis_is_down(app_with: Factory) -> None:
    client = app_with(broker_url="redis://127.0.0.1:1/0")
    assert client.get("/v1/jobs").status_code == 200


def test_the_memory_limiter_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    limiter = TenantLimiter("2/minute", "memory://")
    limiter.hit("acme")
    limiter.hit("acme")
    with pytest.raises(LimitExceededError) as error:
        limiter.hit("acme")
    assert 1 <= error.value.retry_after <= 60
    limiter.hit("globex")


def test_storage_follows_the_broker(settings: Settings) -> None:
    assert limiter_storage_url(settings) == "memory://"  # the embedded filesystem broker
    redis = settings.model_copy(update={"broker_url": "redis://:pw@h:6379/2"})
    assert limiter_storage_url(redis) == "redis://:pw@h:6379/2"


def test_a_bad_rate_fails_at_startup_with_a_sentence() -> None:
    with pytest.raises(ValidationError, match="is not a rate like '100/second'"):
        get_settings(tenant_rate_limit="lots")


def test_the_console_counts_what_changes_state_and_not_what_it_polls(app_with: Factory) -> None:
    client = app_with(tenant_rate_limit="2/minute")
    key = str(client.headers.pop("Authorization")).removeprefix("Bearer ")
    sign_in(client, key)
    assert {client.get("/console/").status_code for _ in range(5)} == {200}  # pages: free
    token = csrf(client.get("/console/try").text)
    png = solid((200, 10, 10))
    answers = [
        client.post(
            "/console/try",
            data={"model": "phash", "csrf": token},
            files=[("files", ("a.png", png, "image/png"))],
            follow_redirects=False,
        )
        for _ in range(3)
    ]
    assert [a.status_code for a in answers] == [303, 303, 429]
    assert "over its rate" in answers[-1].text  # the console's page, with the sentence
