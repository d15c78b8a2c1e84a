"""Completion webhooks' deliveries (`webhook_deliveries`): recorded in the transaction that ends
a job, so no event is lost; claimed by a sender with a lease, so a killed one loses none; then
delivered, retried later, or given up. Never commits: the caller owns the transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, DateTime, Integer, String, cast, exists, func, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db.models import Job, WebhookDelivery, utcnow

PENDING, DELIVERED, GAVE_UP = "pending", "delivered", "gave_up"


def record_end(session: Session, job_id: str, status: str) -> None:
    """Add the delivery of the job's end (`status`: completed, failed or cancelled) if the job
    asked for that event: one INSERT … SELECT from the job's row, nothing when it did not, and
    nothing twice (`(job_id, event)` is unique). Called inside the unit of work that sets the
    final status, so the event commits with it; no HTTP here."""
    now = utcnow()
    wanted = Job.notify.is_not(None) & _asks_for(session, status)
    rows = select(
        literal(str(uuid.uuid4()), String),
        Job.id,
        Job.tenant,
        literal(status, String),
        Job.notify["url"].as_string(),
        # the event's type and time; the job's answer is added at the first attempt
        literal({"type": f"job.{status}", "timestamp": now.isoformat()}, JSON),
        literal(PENDING, String),
        literal(0, Integer),
        literal(now, DateTime(timezone=True)),
        literal(now, DateTime(timezone=True)),
    ).where(Job.id == job_id, wanted)
    columns = [
        "id", "job_id", "tenant", "event", "url", "payload", "status", "attempts",
        "next_attempt_at", "created_at",
    ]  # fmt: skip
    insert = dialect.insert(session, WebhookDelivery).from_select(columns, rows)
    session.execute(insert.on_conflict_do_nothing(index_elements=["job_id", "event"]))


def _asks_for(session: Session, event: str) -> Any:
    """The job's `notify.events` names `event` (JSON, so per database)."""
    if dialect.on_postgres(session):
        events = cast(Job.notify, JSONB).op("->")(literal("events", String))
        return events.op("@>")(func.jsonb_build_array(literal(event, String)))
    listed = func.json_each(Job.notify, "$.events").table_valued("value")
    return exists(select(1).select_from(listed).where(listed.c.value == event))


@dataclass(frozen=True)
class Claimed:
    """A delivery a sender holds until `attempt`'s outcome is recorded or its lease ends."""

    id: str
    job_id: str
    tenant: str
    event: str
    url: str
    payload: dict[str, Any]
    attempt: int  # this attempt's number, from 1: it fences the outcome's record


def claim_due(session: Session, limit: int, lease_s: float) -> list[Claimed]:
    """Take up to `limit` pending deliveries that are due, oldest first: each one's next
    attempt is pushed `lease_s` ahead (its lease: a sender killed mid-send leaves it to be
    claimed again then) and its attempts counted. Rows another sender is claiming are skipped
    (`FOR UPDATE SKIP LOCKED` on Postgres), so senders never wait on each other."""
    now = utcnow()
    due = (
        select(WebhookDelivery.id)
        .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    result = session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.id.in_(due.scalar_subquery()))
        .values(
            next_attempt_at=now + timedelta(seconds=lease_s),
            attempts=WebhookDelivery.attempts + 1,
        )
        .returning(
            WebhookDelivery.id,
            WebhookDelivery.job_id,
            WebhookDelivery.tenant,
            WebhookDelivery.event,
            WebhookDelivery.url,
            WebhookDelivery.payload,
            WebhookDelivery.attempts,
        ),
        execution_options={"synchronize_session": False},
    )
    return [Claimed(*row) for row in result]


def set_payload(session: Session, delivery_id: str, payload: dict[str, Any]) -> None:
    """Keep the body the first attempt built, so every retry sends the same one."""
    session.execute(
        update(WebhookDelivery).where(WebhookDelivery.id == delivery_id).values(payload=payload)
    )


@dataclass(frozen=True)
class Outcome:
    """What one attempt came to: `delivered`, or a retry at `retry_at` (None: given up)."""

    delivered: bool
    http_status: int | None = None
    error: str | None = None
    retry_at: datetime | None = None


def record_attempt(session: Session, claimed: Claimed, outcome: Outcome) -> bool:
    """Record the attempt's outcome, only if the row is still this attempt's (a sender whose
    lease ran out and whose row was claimed again records nothing); whether it did."""
    if outcome.delivered:
        values: dict[str, Any] = {"status": DELIVERED, "delivered_at": utcnow()}
    elif outcome.retry_at is None:
        values = {"status": GAVE_UP}
    else:
        values = {"next_attempt_at": outcome.retry_at}
    result = session.execute(
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == claimed.id,
            WebhookDelivery.attempts == claimed.attempt,
            WebhookDelivery.status == PENDING,
        )
        .values(last_status=outcome.http_status, last_error=outcome.error, **values)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def deliveries_of(session: Session, job_id: str) -> list[WebhookDelivery]:
    """The job's deliveries, in the order they were recorded (the job's answer shows them)."""
    query = select(WebhookDelivery).where(WebhookDelivery.job_id == job_id)
    return list(session.scalars(query.order_by(WebhookDelivery.created_at)))


def pending_count(session: Session) -> int:
    query = select(func.count()).where(WebhookDelivery.status == PENDING)
    return int(session.scalar(query) or 0)
