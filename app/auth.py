"""API keys: random tokens shown once, stored as SHA-256 digests, one tenant each."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db.models import ApiKey, utcnow

_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: "$" allows a "\n"


@dataclass(frozen=True)
class NewKey:
    tenant: str
    prefix: str
    secret: str  # the full key; never stored


def digest(key: str) -> str:
    # Keys carry 256 random bits, so a fast hash is enough: no dictionary to attack.
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, tenant: str) -> NewKey:
    if not _TENANT.fullmatch(tenant):
        raise InputError(
            "A tenant name is 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit."
        )
    prefix = secrets.token_hex(4)
    secret = f"kiln_{prefix}_{secrets.token_urlsafe(32)}"
    session.add(ApiKey(tenant=tenant, prefix=prefix, key_hash=digest(secret)))
    session.flush()
    return NewKey(tenant, prefix, secret)


def tenant_for_key(session: Session, key: str) -> str | None:
    row = session.scalar(
        select(ApiKey).where(ApiKey.key_hash == digest(key), ApiKey.revoked_at.is_(None))
    )
    return row.tenant if row else None


def revoke_key(session: Session, prefix: str) -> None:
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.prefix == prefix, ApiKey.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )
    if not result.rowcount:  # type: ignore[attr-defined]
        raise NotFoundError(f"No active key with prefix {prefix!r}.")
