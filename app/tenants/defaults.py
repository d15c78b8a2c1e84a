"""An operator's per-tenant defaults (`kiln admin tenant set|show`, table `tenant_settings`):
the webhook its jobs report to when they name none, and what other parts add (retention, fair
share's weight). A change is one unit of work (the commit rule: app/__init__.py)."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError
from kiln.app.db.models import TenantSettings, utcnow
from kiln.app.db.session import unit_of_work

# The columns `set_defaults` may change; a new default is its column here and its CLI option.
SETTABLE = ("notify_url", "notify_events", "retention_s", "share_weight")


def set_defaults(session: Session, tenant: str, changes: dict[str, Any]) -> TenantSettings:
    """Set the given defaults of `tenant` (a value of None leaves that one as it was; "" for
    a text clears it), creating its row on first use. Values arrive checked by the caller."""
    unknown = sorted(set(changes) - set(SETTABLE))
    if unknown:
        raise InputError(f"Tenants have no default named {', '.join(unknown)}.")
    if not tenant:
        raise InputError("Name the tenant.")
    with unit_of_work(session):
        row = session.get(TenantSettings, tenant, with_for_update=True)
        if row is None:
            row = TenantSettings(tenant=tenant, share_weight=1.0)
            session.add(row)
        for name, value in changes.items():
            if value is not None:
                setattr(row, name, value if value != "" else None)
        row.updated_at = utcnow()
    return row


def defaults_of(session: Session, tenant: str) -> TenantSettings | None:
    return session.get(TenantSettings, tenant)
