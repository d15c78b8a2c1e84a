"""Each tenant's webhook signing secret, derived from the deployment's (`KILN_WEBHOOK_SECRET`):
nothing to store or rotate per tenant, every API replica and worker derives the same one, and
one tenant's secret tells nothing of another's."""

from __future__ import annotations

import base64
import hashlib
import hmac

from pydantic import SecretStr

from kiln.app.core.errors import ConflictError

PREFIX = "whsec_"  # the Standard Webhooks convention: the rest is the key, base64


def tenant_secret(deployment: SecretStr | None, tenant: str) -> str:
    """`whsec_` + base64(HMAC-SHA256(deployment secret, tenant)): the key a receiver verifies
    the tenant's deliveries with (standardwebhooks' `Webhook(secret).verify`)."""
    if deployment is None:
        raise ConflictError(
            "This deployment sends no webhooks: its operator has not set KILN_WEBHOOK_SECRET."
        )
    key = deployment.get_secret_value().encode()
    digest = hmac.new(key, f"kiln-webhooks:{tenant}".encode(), hashlib.sha256).digest()
    return PREFIX + base64.b64encode(digest).decode()
