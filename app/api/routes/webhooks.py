"""/v1/webhooks: the caller's signing secret; and what the job routes use of webhooks (the
check of a job's webhook, its deliveries in the job's answer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from sqlalchemy.orm import Session

from kiln.app.api.deps import SettingsDep, TenantDep
from kiln.app.api.errors import error_responses
from kiln.app.api.schemas import DeliveryOut, NotifyOut
from kiln.app.core.config import Settings
from kiln.app.db import webhooks as deliveries
from kiln.app.db.models import Job
from kiln.app.jobs.webhooks import check_url
from kiln.app.tenants.webhook_secret import tenant_secret

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


@router.get("/secret", responses=error_responses(401, 409, 429))
def get_secret(tenant: TenantDep, settings: SettingsDep) -> dict[str, str]:
    """The key your receiver verifies Kiln's webhooks with (Standard Webhooks: `whsec_…`;
    e.g. `standardwebhooks.Webhook(secret).verify(body, headers)`)."""
    return {"secret": tenant_secret(settings.webhook_secret, tenant)}


def checked_notify(notify: dict[str, Any] | None, settings: Settings) -> dict[str, Any] | None:
    """The job's webhook as it is stored, once its URL passes (`check_url`: a 422 with a
    sentence otherwise) and the deployment can sign (a 409 when it has no secret)."""
    if notify is None:
        return None
    check_url(notify["url"], settings.webhook_allow_private)  # may resolve the host: in a thread
    tenant_secret(settings.webhook_secret, "")  # refuses when nothing could be signed
    return {"url": notify["url"], "events": list(notify["events"])}


def notify_out(session: Session, job: Job) -> NotifyOut | None:
    """The job's webhook and its deliveries' attempts, for its answer."""
    if not job.notify:
        return None
    rows = deliveries.deliveries_of(session, job.id)
    return NotifyOut(
        url=job.notify.get("url", ""),
        events=list(job.notify.get("events") or []),
        deliveries=[
            DeliveryOut(
                id=d.id,
                event=d.event,
                status=d.status,
                attempts=d.attempts,
                last_status=d.last_status,
                last_error=d.last_error,
                next_attempt_at=d.next_attempt_at if d.status == deliveries.PENDING else None,
                delivered_at=d.delivered_at,
            )
            for d in rows
        ],
    )
