"""A tenant's weight in the bulk queue's fair share (`tenant_settings.share_weight`; read by
app/db/fair_share.py). `kiln admin tenant set NAME --weight W` writes it; no row reads as 1."""

from __future__ import annotations

import math

from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError
from kiln.app.db.models import TenantSettings

DEFAULT_WEIGHT = 1.0
MAX_WEIGHT = 1000.0


def check_weight(weight: float) -> float:
    """A weight is a positive number up to `MAX_WEIGHT` (a share of 0 would starve the tenant;
    cancel its jobs instead)."""
    if not math.isfinite(weight) or weight <= 0 or weight > MAX_WEIGHT:
        raise InputError(
            f"A tenant's weight must be above 0 and at most {MAX_WEIGHT:g}, not {weight:g}."
        )
    return weight


def set_weight(session: Session, tenant: str, weight: float) -> TenantSettings:
    """Set `tenant`'s weight (creating its settings row): one unit of work."""
    from kiln.app.tenants.defaults import set_defaults

    return set_defaults(session, tenant, {"share_weight": check_weight(weight)})


def weight_of(session: Session, tenant: str) -> float:
    row = session.get(TenantSettings, tenant)
    return DEFAULT_WEIGHT if row is None or row.share_weight is None else float(row.share_weight)
