"""Retention's policy: how long a closed job's items and results are kept, and what the job
says of it. The job's own `expires_after` wins, then its tenant's setting (`kiln admin tenant
set --retention`), then the deployment's `KILN_RETENTION`; none of them: kept for ever. No
retention may exceed `KILN_RETENTION_MAX`. The sweep that deletes what expired is
`workers/jobs/retention.py`; its statements are `app/db/retention.py`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from kiln.app.core.config import Settings
from kiln.app.core.durations import LONGEST_S, describe, parse_duration
from kiln.app.core.errors import ConflictError, InputError
from kiln.app.db import queries
from kiln.app.db.models import Job, TenantSettings, aware


def check_retention(value: int | str, settings: Settings, what: str = "expires_after") -> int:
    """Seconds from a job's `expires_after` (or a tenant's setting), or an InputError (422)
    with a sentence: not a duration, zero or negative, or beyond the operator's maximum."""
    try:
        seconds = _text(value) if isinstance(value, str) else parse_duration(value)
    except ValueError as error:
        raise InputError(f"{what}: {error}") from None
    if seconds <= 0:
        raise InputError(
            f"{what} must be longer than zero; {value!r} would delete the results at once."
        )
    most = settings.retention_max or LONGEST_S
    if seconds > most:
        raise InputError(
            f"{what} is {describe(seconds)}; this deployment keeps results at most "
            f"{describe(most)}"
            + (
                " (KILN_RETENTION_MAX)."
                if settings.retention_max
                else "; leave it out to keep them."
            )
        )
    return seconds


def _text(value: str) -> int:
    text = value.strip()
    if text.startswith("-"):  # a sentence about the sign rather than the shape
        return -1
    return parse_duration(text)


def retention_of(session: Session, settings: Settings, job: Job) -> int | None:
    """The seconds `job` is kept after it ends (None: for ever): its own, else its tenant's,
    else the deployment's."""
    if job.retention_s is not None:
        return job.retention_s
    tenant = session.get(TenantSettings, job.tenant)
    if tenant is not None and tenant.retention_s is not None:
        return tenant.retention_s
    return settings.retention


def expires_at(session: Session, settings: Settings, job: Job) -> datetime | None:
    """When the job's items and results go: what the sweep stamped, or for a job that ended
    since its last tick, the same sum (its end plus its retention) computed now."""
    if job.expires_at is not None or job.finished_at is None or queries.is_open(job):
        return aware(job.expires_at)
    seconds = retention_of(session, settings, job)
    finished = aware(job.finished_at)
    return None if seconds is None or finished is None else finished + timedelta(seconds=seconds)


def summary_counts(job: Job) -> queries.Counts | None:
    """The counts an expired job kept (its counters went with its items); None otherwise."""
    if not job.summary or "counts" not in job.summary:
        return None
    fields = queries.Counts.__dataclass_fields__
    return queries.Counts(**{k: v for k, v in job.summary["counts"].items() if k in fields})


def summary_of(job: Job, counts: queries.Counts, output: str) -> dict[str, Any]:
    """The one-row summary a job keeps once its items and results are deleted."""
    return {
        "counts": {
            name: getattr(counts, name)
            for name in queries.Counts.__dataclass_fields__
            if name != "listing"
        },
        "output": output,  # where its results were
        "model": job.model,
    }


def check_not_expired(job: Job) -> None:
    """409 with a sentence for what needs an expired job's items or results."""
    if job.expired_at is not None or job.summary is not None:
        when = aware(job.expired_at)
        at = f" at {when:%Y-%m-%d %H:%M} UTC" if when else ""
        raise ConflictError(
            f"Job {job.id}'s items and results were deleted by retention{at}; only its "
            "summary (its counts) is kept."
        )
