"""Per-tenant limits at the API: a request rate and a cap on open jobs, both answered with 429.

The rate is counted by the `limits` library, in Redis when the broker is Redis (so every API
process shares one count) and in memory otherwise (the embedded demo: one process). Counting is
a convenience, not a gate worth an outage: if Redis is down the limiter lets requests through
and logs a warning, never a 500.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.app.core.config import Settings, redact_url
from kiln.app.core.errors import LimitExceededError
from kiln.app.db import dialect
from kiln.app.db.models import OPEN_JOB_STATUSES, Job

if TYPE_CHECKING:
    from limits import RateLimitItem
    from limits.storage import Storage

# `limits` is imported by the API's limiter alone: the open-jobs check (`kiln run`'s submit,
# every worker) does not pay for it.

log = logging.getLogger(__name__)

NAMESPACE = "kiln-tenant"
REDIS_TIMEOUT_S = 0.5  # a hung Redis must not hold every request
FAIL_OPEN_S = 5.0  # after a storage error, skip counting this long instead of retrying each call
OPEN_JOBS_RETRY_S = 10  # jobs take seconds to finish: a sooner retry would only be refused


def limiter_storage_url(settings: Settings) -> str:
    broker = settings.broker_url
    return broker if broker.startswith(("redis://", "rediss://")) else "memory://"


class TenantLimiter:
    """Counts each tenant's requests against `KILN_TENANT_RATE_LIMIT`."""

    def __init__(self, rate: str, storage_url: str) -> None:
        from limits import parse_many
        from limits.storage import MemoryStorage, RedisStorage
        from limits.strategies import SlidingWindowCounterRateLimiter

        self.limits: list[RateLimitItem] = parse_many(rate)
        # Creating the storage opens no connection; the first request does.
        self.storage: Storage = (
            RedisStorage(
                storage_url,
                socket_timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S,
            )
            if storage_url.startswith("redis")
            else MemoryStorage()
        )
        self.strategy = SlidingWindowCounterRateLimiter(self.storage)
        self._open_until = 0.0
        log.info("tenant rate limit %s, counted in %s", rate, redact_url(storage_url))

    @classmethod
    def for_settings(cls, settings: Settings) -> TenantLimiter:
        return cls(settings.tenant_rate_limit, limiter_storage_url(settings))

    def hit(self, tenant: str) -> None:
        """Count one request; raise LimitExceededError (429) when the tenant is over."""
        if time.monotonic() < self._open_until:
            return
        try:
            for limit in self.limits:
                if not self.strategy.hit(limit, NAMESPACE, tenant):
                    raise LimitExceededError(
                        f"Tenant {tenant!r} is over its rate of {limit}; slow down and retry.",
                        self._retry_after(limit, tenant),
                    )
        except LimitExceededError:
            raise
        except Exception as error:  # Redis down or confused: fail open, loudly
            self._open_until = time.monotonic() + FAIL_OPEN_S
            log.warning("rate limiter unavailable, not limiting for %.0f s: %s", FAIL_OPEN_S, error)

    def _retry_after(self, limit: RateLimitItem, tenant: str) -> int:
        reset = self.strategy.get_window_stats(limit, NAMESPACE, tenant).reset_time
        return max(1, math.ceil(reset - time.time()))


OPEN_JOBS_LOCK = 0x6B696C6E  # "kiln": the advisory-lock space of the open-jobs quota


def check_open_jobs(session: Session, tenant: str, most: int | None) -> None:
    """Refuse a new job (429) when the tenant already has `most` open ones (None: no cap).

    Call inside the transaction that adds the job. On Postgres it first takes a per-tenant
    advisory lock, held until that transaction ends, so submissions of one tenant count and
    insert one at a time: twenty racing at the limit cannot all pass. (SQLite, the embedded
    default, allows one writer at a time anyway.)
    """
    if most is None:
        return
    if dialect.on_postgres(session):
        session.execute(select(func.pg_advisory_xact_lock(OPEN_JOBS_LOCK, func.hashtext(tenant))))
    count = session.scalar(
        select(func.count())
        .select_from(Job)
        .where(Job.tenant == tenant, Job.status.in_(OPEN_JOB_STATUSES))
    )
    if (count or 0) >= most:
        raise LimitExceededError(
            f"Tenant {tenant!r} has {count} open jobs, the most allowed; wait for some to finish.",
            OPEN_JOBS_RETRY_S,
        )
