"""When a failed delivery is tried again: Standard Webhooks' schedule (5 s, 5 min, 30 min, 2 h,
5 h, 10 h, 10 h by default: `KILN_WEBHOOK_BACKOFF_S`), then never."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta


def retry_at(attempt: int, schedule: Sequence[float], now: datetime) -> datetime | None:
    """After attempt number `attempt` (from 1) failed: when to try again, or None once the
    schedule is spent (the delivery gives up after len(schedule) + 1 attempts)."""
    if attempt < 1 or attempt > len(schedule):
        return None
    return now + timedelta(seconds=schedule[attempt - 1])
