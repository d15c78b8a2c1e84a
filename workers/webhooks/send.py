"""One attempt of one delivery: sign the body (Standard Webhooks: `webhook-id`,
`webhook-timestamp`, `webhook-signature`, HMAC-SHA256 over id, timestamp and body, with the
tenant's secret) and POST it. A 2xx is delivered; anything else is a failure with its reason."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import httpx
from standardwebhooks.webhooks import Webhook

from kiln.app.db.webhooks import Outcome

USER_AGENT = "Kiln-Webhooks/1"
ERROR_CHARS = 500  # of a receiver's answer or an exception, kept as last_error


def body_of(payload: dict[str, Any]) -> str:
    """The exact bytes signed and sent (compact JSON)."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def signed_headers(secret: str, delivery_id: str, body: str, now: datetime) -> dict[str, str]:
    return {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(secret).sign(delivery_id, now, body),
    }


def post(client: httpx.Client, url: str, headers: dict[str, str], body: str) -> Outcome:
    """POST once (the client's timeout; redirects are not followed: a receiver answers where
    it was named); the outcome without its retry time (the caller's)."""
    try:
        response = client.post(url, content=body.encode(), headers=headers)
    except httpx.TimeoutException:
        return Outcome(False, error="The receiver did not answer in time.")
    except httpx.HTTPError as error:
        return Outcome(False, error=f"Could not reach the receiver: {error}"[:ERROR_CHARS])
    if response.is_success:
        return Outcome(True, http_status=response.status_code)
    reason = f"The receiver answered HTTP {response.status_code}: {response.text.strip()}"
    return Outcome(False, http_status=response.status_code, error=reason[:ERROR_CHARS])
