"""A tenant's fair-share weight (app/tenants/shares.py): set, read back, 1 without a row, and
refused with a sentence when it is not a positive number up to the maximum."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError
from kiln.app.db.models import TenantSettings
from kiln.app.tenants.shares import MAX_WEIGHT, set_weight, weight_of


def test_a_tenant_without_settings_weighs_one(session: Session) -> None:
    assert weight_of(session, "acme") == 1.0


def test_a_weight_set_is_read_back_and_changed_in_place(session: Session) -> None:
    set_weight(session, "acme", 2.5)
    set_weight(session, "acme", 3)
    assert weight_of(session, "acme") == 3.0
    assert session.query(TenantSettings).count() == 1


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), MAX_WEIGHT + 1])
def test_a_weight_that_is_not_a_positive_number_is_refused(session: Session, weight: float) -> None:
    with pytest.raises(InputError, match="weight must be above 0"):
        set_weight(session, "acme", weight)
    assert weight_of(session, "acme") == 1.0
