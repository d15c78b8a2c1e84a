"""Which S3 buckets a tenant may name: an allow-list kept by operators (`kiln tenants`).

A tenant with no bucket on its list has no S3 access at all; uploads still work. The check runs
wherever a user names an `s3://` URI (inputs, bulk sources and outputs, schedules, model files),
before anything is read, so Kiln's own credentials never fetch a bucket the tenant was not given.
Allowing and denying are units of work (the commit rule: app/__init__.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from kiln.app.core.errors import ForbiddenError, InputError, NotFoundError
from kiln.app.db.models import ApiKey, TenantBucket
from kiln.app.db.session import unit_of_work
from kiln.app.sources import parse_s3_uri

# S3's own rule for bucket names (3-63 lowercase letters, digits, '.' and '-'), loosened to 255
# characters as some S3-compatible stores allow; a name outside it is a typo, not a bucket.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]")


@dataclass(frozen=True)
class TenantSummary:
    tenant: str
    active_keys: int
    buckets: tuple[str, ...]


def bucket_of(uri_or_bucket: str) -> str:
    """The bucket of `s3://bucket/key`, or the name itself when given a bare bucket."""
    if "://" in uri_or_bucket:
        return parse_s3_uri(uri_or_bucket)[0]
    return uri_or_bucket


def _checked_name(bucket: str) -> str:
    if not _BUCKET.fullmatch(bucket):
        raise InputError(f"{bucket!r} is not a bucket name (lowercase letters, digits, '.', '-').")
    return bucket


def allow_bucket(session: Session, tenant: str, uri_or_bucket: str) -> bool:
    """Put the bucket on the tenant's list; False if it was there already."""
    with unit_of_work(session):
        return stage_bucket(session, tenant, uri_or_bucket)


def stage_bucket(session: Session, tenant: str, uri_or_bucket: str) -> bool:
    """`allow_bucket` inside the caller's unit of work (a new key's buckets), uncommitted."""
    bucket = _checked_name(bucket_of(uri_or_bucket))
    if session.get(TenantBucket, (tenant, bucket)) is not None:
        return False
    session.add(TenantBucket(tenant=tenant, bucket=bucket))
    session.flush()
    return True


def deny_bucket(session: Session, tenant: str, uri_or_bucket: str) -> None:
    """Take the bucket off the tenant's list (jobs already submitted go on)."""
    bucket = bucket_of(uri_or_bucket)
    with unit_of_work(session):
        result = session.execute(
            delete(TenantBucket).where(TenantBucket.tenant == tenant, TenantBucket.bucket == bucket)
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise NotFoundError(f"Tenant {tenant!r} has no bucket {bucket!r} on its list.")


def allowed_buckets(session: Session, tenant: str) -> set[str]:
    rows = session.scalars(select(TenantBucket.bucket).where(TenantBucket.tenant == tenant))
    return set(rows)


def check_bucket(session: Session, tenant: str, uri_or_bucket: str) -> None:
    """Raise ForbiddenError (403) unless the tenant may read this URI's bucket."""
    check_buckets(session, tenant, [uri_or_bucket])


def check_buckets(
    session: Session, tenant: str, uris_or_buckets: Iterable[str], verb: str = "read"
) -> None:
    """`check_bucket` for many URIs (a job's inputs) with one query. `verb` says what the
    tenant would do there ("read", or "write to" for an output): one list allows both."""
    wanted = {bucket_of(u) for u in uris_or_buckets}
    if not wanted:
        return
    missing = sorted(wanted - allowed_buckets(session, tenant))
    if missing:
        raise ForbiddenError(
            f"Tenant {tenant!r} may not {verb} bucket {missing[0]!r}; an operator can allow it "
            f"with `kiln tenants allow-bucket {tenant} {missing[0]}`."
        )


def list_tenants(session: Session) -> list[TenantSummary]:
    """Every tenant with an active key or an allowed bucket, by name."""
    keys = dict(
        session.execute(
            select(ApiKey.tenant, func.count())
            .where(ApiKey.revoked_at.is_(None))
            .group_by(ApiKey.tenant)
        ).all()
    )
    buckets: dict[str, list[str]] = {}
    for tenant, bucket in session.execute(
        select(TenantBucket.tenant, TenantBucket.bucket).order_by(TenantBucket.bucket)
    ):
        buckets.setdefault(tenant, []).append(bucket)
    names = sorted(set(keys) | set(buckets))
    return [TenantSummary(t, int(keys.get(t, 0)), tuple(buckets.get(t, ()))) for t in names]
