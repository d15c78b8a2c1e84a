"""Signing and the retry schedule: what a receiver verifies with standardwebhooks' own
`Webhook.verify`, and when a failed delivery is tried again."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import SecretStr
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from kiln.app.tenants.webhook_secret import tenant_secret
from kiln.workers.webhooks.backoff import retry_at
from kiln.workers.webhooks.send import body_of, signed_headers

STANDARD = [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0]


def test_a_signed_delivery_verifies_with_the_tenant_s_secret() -> None:
    secret = tenant_secret(SecretStr("deployment-secret-0123456789"), "acme")
    payload = {"type": "job.completed", "timestamp": "2026-11-29T04:00:00+00:00",
               "data": {"id": "j1", "status": "completed", "note": "naïve ✓"}}  # fmt: skip
    body = body_of(payload)
    headers = signed_headers(secret, "delivery-1", body, datetime.now(UTC))

    assert Webhook(secret).verify(body, headers) == payload
    assert headers["webhook-id"] == "delivery-1"
    other = tenant_secret(SecretStr("deployment-secret-0123456789"), "globex")
    with pytest.raises(WebhookVerificationError):
        Webhook(other).verify(body, headers)  # another tenant's secret
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body.replace("completed", "failed"), headers)  # tampered
    assert json.loads(body) == payload


def test_an_old_signature_is_refused_by_the_receiver() -> None:
    """The timestamp is signed: a replay minutes later fails the receiver's tolerance."""
    secret = tenant_secret(SecretStr("deployment-secret-0123456789"), "acme")
    body = body_of({"type": "job.failed"})
    stale = signed_headers(secret, "d", body, datetime.now(UTC) - timedelta(minutes=10))
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, stale)


def test_retries_follow_the_standard_schedule_then_give_up() -> None:
    now = datetime(2026, 11, 29, tzinfo=UTC)
    waits = [retry_at(attempt, STANDARD, now) for attempt in range(1, 9)]
    assert [(w - now).total_seconds() for w in waits[:7] if w] == STANDARD
    assert waits[7] is None  # the eighth attempt failed: given up
    assert retry_at(0, STANDARD, now) is None


def test_the_schedule_and_the_secret_as_an_environment_gives_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic import ValidationError

    for name in ("KILN_WEBHOOK_BACKOFF_S", "KILN_WEBHOOK_SECRET"):
        monkeypatch.delenv(name, raising=False)

    from kiln.app.core.config import get_settings

    assert get_settings(webhook_backoff_s="[1, 2.5]").webhook_backoff_s == [1.0, 2.5]
    assert get_settings(webhook_backoff_s="5,300").webhook_backoff_s == [5.0, 300.0]
    assert get_settings().webhook_backoff_s == STANDARD
    for text in ("5,300", "[5, 300]"):  # as the environment gives it, not only as a keyword
        monkeypatch.setenv("KILN_WEBHOOK_BACKOFF_S", text)
        assert get_settings().webhook_backoff_s == [5.0, 300.0]
    with pytest.raises(ValidationError, match="at least 16"):
        get_settings(webhook_secret="short")
