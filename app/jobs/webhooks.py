"""A job's completion webhook: which URL it may name, the tenant's default when it names none,
and the event's body. Sending is the workers' (workers/webhooks); the pending deliveries are
rows (app/db/webhooks.py)."""

from __future__ import annotations

import ipaddress
import socket
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db import queries
from kiln.app.db.models import Job, TenantSettings
from kiln.app.jobs import job_lookup

EVENTS = ("completed", "failed", "cancelled")
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Notify = dict[str, Any]  # a job's webhook as stored: {"url", "events"}


def check_url(url: str, allow_private: bool) -> None:
    """Refuse (InputError) a webhook URL that is not http(s), whose host does not resolve, or
    that resolves to a private, loopback, link-local or reserved address, unless the operator
    allows those (`KILN_WEBHOOK_ALLOW_PRIVATE`): an API user must not reach inside the
    deployment's network through Kiln. Every address the name resolves to is checked, so a
    name with one public and one private address is refused too."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"A webhook URL must be http:// or https:// with a host; {url!r} is not.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise InputError(f"The webhook URL {url!r} has no valid port.") from None
    if allow_private:
        return
    for address in resolve(parts.hostname, port):
        if not is_public(address):
            raise InputError(
                f"The webhook URL {url!r} reaches {address}, a private, loopback, link-local or "
                "reserved address; Kiln calls only public addresses unless its operator sets "
                "KILN_WEBHOOK_ALLOW_PRIVATE=true."
            )


def resolve(host: str, port: int) -> list[IpAddress]:
    """The host's addresses (an IP literal is its own); InputError when the name does not
    resolve: a webhook nobody can reach would fail every delivery for hours."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise InputError(
            f"The webhook host {host!r} is unreachable: its name does not resolve."
        ) from None
    return [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found]


def is_public(address: IpAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    return address.is_global and not address.is_multicast


def notify_of(asked: Notify | None, default: TenantSettings | None) -> Notify | None:
    """What the job stores in `notify`: the webhook it asked for, else its tenant's default
    (checked when the operator set it), else none."""
    if asked is not None:
        return {"url": asked["url"], "events": _events(asked.get("events"))}
    if default is None or not default.notify_url:
        return None
    return {"url": default.notify_url, "events": _events(default.notify_events)}


def job_notify(session: Session, tenant: str, asked: Notify | None) -> Notify | None:
    """`notify_of` with the tenant's defaults read (only when the job names no webhook)."""
    return notify_of(asked, None if asked is not None else session.get(TenantSettings, tenant))


def _events(events: list[Any] | None) -> list[str]:
    return [e for e in EVENTS if e in events] if events else list(EVENTS)


def parse_events(text: str) -> list[str]:
    """`completed,failed` as the CLI takes it; InputError naming the unknown ones."""
    events = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in events if e not in EVENTS]
    if unknown or not events:
        raise InputError(
            f"Webhook events are {', '.join(EVENTS)}; {', '.join(unknown) or 'none'} given."
        )
    return [e for e in EVENTS if e in events]


def event_body(session: Session, job: Job, event: str, at: datetime) -> dict[str, Any]:
    """The body a delivery POSTs: the event's type and time and the job's answer (what
    `GET /v1/jobs/{id}` says of a closed job, without its links)."""
    c = queries.job_counts(session, job.id, bulk=job.source is not None)
    return {
        "type": f"job.{event}",
        "timestamp": at.isoformat(),
        "data": {
            "id": job.id,
            "model": job.model,
            "status": job.status,
            "counts": {
                "total": c.total,
                "done": c.done,
                "succeeded": c.succeeded,
                "failed": c.failed,
                "cancelled": c.cancelled,
                "skipped": c.skipped,
                "deleted": c.deleted,
                "known_failed": c.known_failed,
                "excluded": c.excluded,
                "fell_back": c.fell_back,
            },
            "created_at": _iso(job.created_at),
            "started_at": _iso(job.started_at),
            "finished_at": _iso(job.finished_at),
            "error": job.error,
            "source": job.source,
            "pipeline": job_lookup.pipeline_name(session, job),
            "schedule": job.schedule,
            "output": job.output,
            "options": job.options or {},
            "retry_of": job.retry_of,
        },
    }


def job_event_body(session: Session, job_id: str, event: str, at: datetime) -> dict[str, Any]:
    """`event_body` of the job by its id; NotFoundError if it is gone (deleting a job takes
    its deliveries with it, so only a race sees this)."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"There is no job {job_id}.")
    return event_body(session, job, event, at)


def _iso(when: datetime | None) -> str | None:
    return when.isoformat() if when else None
