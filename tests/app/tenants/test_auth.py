"""API keys: shown once, stored as SHA-256 digests, one tenant each, revocable."""

from __future__ import annotations

import hashlib

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db.models import ApiKey
from kiln.app.tenants.auth import create_key, digest, revoke_key, tenant_for_key


def test_create_key_returns_a_secret_with_its_prefix(session: Session) -> None:
    key = create_key(session, "acme")
    session.commit()
    assert key.tenant == "acme"
    assert len(key.prefix) == 8
    assert key.secret.startswith(f"kiln_{key.prefix}_")
    assert len(key.secret) > len(f"kiln_{key.prefix}_") + 40  # 32 random bytes, urlsafe


def test_only_the_digest_is_stored(session: Session) -> None:
    key = create_key(session, "acme")
    session.commit()

    row = session.scalars(select(ApiKey)).one()
    assert row.tenant == "acme"
    assert row.prefix == key.prefix
    assert row.key_hash == hashlib.sha256(key.secret.encode()).hexdigest() == digest(key.secret)
    assert row.revoked_at is None
    raw = session.execute(text("SELECT * FROM api_keys")).one()
    assert not any(key.secret in str(value) for value in raw)


def test_keys_are_unique(session: Session) -> None:
    first, second = create_key(session, "acme"), create_key(session, "acme")
    assert first.secret != second.secret
    assert first.prefix != second.prefix


def test_tenant_for_key(session: Session) -> None:
    acme, globex = create_key(session, "acme"), create_key(session, "globex")
    session.commit()
    assert tenant_for_key(session, acme.secret) == "acme"
    assert tenant_for_key(session, globex.secret) == "globex"
    assert tenant_for_key(session, "kiln_00000000_not-a-key") is None
    assert tenant_for_key(session, "") is None
    assert tenant_for_key(session, digest(acme.secret)) is None  # the digest is not a key


def test_revoked_keys_stop_working(session: Session) -> None:
    revoked, kept = create_key(session, "acme"), create_key(session, "acme")
    session.commit()

    revoke_key(session, revoked.prefix)
    session.commit()

    assert tenant_for_key(session, revoked.secret) is None
    assert tenant_for_key(session, kept.secret) == "acme"
    row = session.scalars(select(ApiKey).where(ApiKey.prefix == revoked.prefix)).one()
    assert row.revoked_at is not None


def test_revoking_twice_is_not_found(session: Session) -> None:
    key = create_key(session, "acme")
    revoke_key(session, key.prefix)
    session.commit()
    with pytest.raises(NotFoundError, match=f"No active key with prefix '{key.prefix}'"):
        revoke_key(session, key.prefix)


def test_revoking_an_unknown_prefix_is_not_found(session: Session) -> None:
    with pytest.raises(NotFoundError):
        revoke_key(session, "deadbeef")


@pytest.mark.parametrize(
    "tenant",
    [
        "",
        "-acme",
        ".acme",
        "acme corp",
        "acme/evil",
        "ümlaut",
        "a" * 129,
        pytest.param("acme\n", id="trailing-newline"),
    ],
)
def test_a_bad_tenant_name_is_an_input_error(session: Session, tenant: str) -> None:
    with pytest.raises(InputError, match="tenant name"):
        create_key(session, tenant)
    assert session.scalars(select(ApiKey)).all() == []


@pytest.mark.parametrize("tenant", ["a", "acme", "Acme-Corp_2.eu", "a" * 128])
def test_good_tenant_names(session: Session, tenant: str) -> None:
    key = create_key(session, tenant)
    assert tenant_for_key(session, key.secret) == tenant
