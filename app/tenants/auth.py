"""API keys: random tokens shown once, stored as SHA-256 digests, one tenant each.

Creating and revoking a key are units of work (the commit rule: app/__init__.py).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db.models import ApiKey, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.tenants.tenants import stage_bucket

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: "$" allows a "\n"


@dataclass(frozen=True)
class NewKey:
    tenant: str
    prefix: str
    secret: str  # the full key; never stored


def digest(key: str) -> str:
    # Keys carry 256 random bits, so a fast hash is enough: no dictionary to attack.
    return sha256_hex(key)


def create_key(session: Session, tenant: str, buckets: Sequence[str] = ()) -> NewKey:
    """A new key for `tenant`, which may then also read `buckets`: all of it or nothing."""
    if not _TENANT.fullmatch(tenant):
        raise InputError(
            "A tenant name is 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    prefix = secrets.token_hex(4)
    secret = f"kiln_{prefix}_{secrets.token_urlsafe(32)}"
    with unit_of_work(session):
        session.add(ApiKey(tenant=tenant, prefix=prefix, key_hash=digest(secret)))
        session.flush()
        for bucket in buckets:
            stage_bucket(session, tenant, bucket)
    return NewKey(tenant, prefix, secret)


def tenant_for_key(session: Session, key: str) -> str | None:
    row = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == digest(key), ApiKey.revoked_at.is_(None))
    )
    return row.tenant if row else None


def revoke_key(session: Session, prefix: str) -> None:
    with unit_of_work(session):
        result = session.execute(
            update(ApiKey)
            .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
            .values(revoked_at=utcnow())
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise NotFoundError(f"No active key with prefix {prefix!r}.")
