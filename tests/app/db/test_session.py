"""`unit_of_work`: what the block wrote is committed when it ends, rolled back if it raises."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db.models import TenantBucket
from kiln.app.db.session import unit_of_work


def buckets(sessions: sessionmaker[Session]) -> int:
    """Rows another session sees: only committed ones."""
    with sessions() as other:
        return int(other.scalar(select(func.count()).select_from(TenantBucket)) or 0)


def test_the_block_is_committed(session: Session, sessions: sessionmaker[Session]) -> None:
    with unit_of_work(session):
        session.add(TenantBucket(tenant="acme", bucket="photos"))
    assert buckets(sessions) == 1


def test_an_error_rolls_the_block_back_and_goes_on(
    session: Session, sessions: sessionmaker[Session]
) -> None:
    with pytest.raises(LookupError), unit_of_work(session):
        session.add(TenantBucket(tenant="acme", bucket="photos"))
        session.flush()
        raise LookupError
    assert buckets(sessions) == 0
    assert session.scalar(select(func.count()).select_from(TenantBucket)) == 0  # not pending


def test_a_failed_commit_is_rolled_back(session: Session, sessions: sessionmaker[Session]) -> None:
    session.add(TenantBucket(tenant="acme", bucket="photos"))
    session.commit()  # the test's own setup; Kiln's code commits only through unit_of_work
    with pytest.raises(IntegrityError), unit_of_work(session):
        session.add(TenantBucket(tenant="acme", bucket="photos"))  # fails at the commit's flush
    with unit_of_work(session):  # the session is usable again
        session.add(TenantBucket(tenant="acme", bucket="other"))
    assert buckets(sessions) == 2
