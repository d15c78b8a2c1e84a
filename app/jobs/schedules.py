"""Schedules: cron-timed runs of an incremental pipeline, started by `kiln beat`.

Each writing function is one unit of work (the commit rule: app/__init__.py); so is each
scheduled run.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from croniter import CroniterBadCronError, croniter
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import get_model
from kiln.app.core.errors import ConflictError, ForbiddenError, InputError, NotFoundError
from kiln.app.db.dialect import on_postgres
from kiln.app.db.models import Job, Schedule, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.jobs import outputs
from kiln.app.jobs.ingest import (
    NAME_PATTERN,
    BulkRequest,
    Source,
    check_places,
    stage_bulk,
    start_ingest,
)
from kiln.app.jobs.jobs import check_options
from kiln.app.observability.tracing import traced
from kiln.app.storage.base import S3Factory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduleRequest:
    tenant: str
    name: str
    cron: str
    source: Source
    model: str
    output: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    retry_failed: bool = False  # every run retries the pipeline's known failures


CRON_SHORTHANDS = ("@hourly", "@daily", "@midnight", "@weekly", "@monthly", "@yearly", "@annually")
WHAT_CRON_IS = (
    "A cron expression is five fields, minute hour day-of-month month weekday, in UTC "
    "(e.g. '0 2 * * *': 02:00 every day), or one of @hourly, @daily, @weekly, @monthly, "
    "@yearly."
)


def check_cron(cron: str) -> str:
    """The cron expression as stored (its fields single-spaced), or an InputError saying what
    is wrong with it and what a cron expression is."""
    fields = cron.split()
    if len(fields) == 1 and fields[0].startswith("@"):
        if fields[0].lower() not in CRON_SHORTHANDS:
            raise InputError(f"{cron!r} is not a cron expression Kiln knows. {WHAT_CRON_IS}")
        return fields[0].lower()
    if len(fields) != 5:
        count = f"{len(fields)} field{'' if len(fields) == 1 else 's'}"
        raise InputError(f"{cron!r} has {count}, not five. {WHAT_CRON_IS}")
    expression = " ".join(fields)
    try:
        croniter(expression)
    except (CroniterBadCronError, ValueError, KeyError) as error:
        why = _why(error)
        raise InputError(f"{cron!r} is not a cron expression: {why}. {WHAT_CRON_IS}") from None
    return expression


def _why(error: Exception) -> str:
    """croniter's reason, as part of a sentence ("[61 * * * *] is not acceptable, out of range"
    → "a field is out of range (…)")."""
    said = re.sub(r"^\[.*?\]\s*", "", str(error)).rstrip(".")
    if "out of range" in said:
        return (
            "a field is out of range (minute 0-59, hour 0-23, day 1-31, month 1-12, "
            "weekday 0-6 or sun-sat)"
        )
    if not said or said == "is not acceptable":
        return "a field is not a number, a name, a range (1-5), a list (1,3), a step (*/15) or *"
    return said


def next_run(cron: str, after: datetime) -> datetime:
    """The first time after `after` that `cron` (checked by `check_cron`, UTC) names."""
    return croniter(check_cron(cron), after).get_next(datetime)


def add_schedule(
    session: Session, request: ScheduleRequest, *, s3: S3Factory | None = None
) -> Schedule:
    """Record the schedule once its parts are checked; `s3`: Kiln's S3 clients, to probe its
    `output` as a bulk job's is (`outputs.check_output`)."""
    if not re.fullmatch(NAME_PATTERN, request.name):
        raise InputError("A schedule name is letters, digits, '.', '_' or '-' (up to 128).")
    cron = check_cron(request.cron)
    when = next_run(cron, utcnow())
    request.source.check()
    if request.output:
        outputs.output_prefix(request.output)
    try:
        model = get_model(session, request.model, request.tenant)
    except NotFoundError as error:
        raise InputError(str(error)) from None
    check_options(session, request.tenant, model, request.options)  # runs pin their own
    check_places(session, request.tenant, request.source, request.output)
    if s3 is not None and request.output:
        outputs.check_output(session, request.tenant, request.output, s3)
    schedule = Schedule(
        tenant=request.tenant,
        name=request.name,
        cron=cron,
        source=request.source.to_json(),
        model=request.model,
        output=request.output,
        options=request.options,
        retry_failed=request.retry_failed,
        next_run_at=when,
    )
    try:
        with unit_of_work(session):
            session.add(schedule)
    except IntegrityError:  # rolled back
        raise ConflictError(f"There is already a schedule named {request.name!r}.") from None
    return schedule


def list_schedules(session: Session, tenant: str) -> list[Schedule]:
    return list(
        session.scalars(select(Schedule).where(Schedule.tenant == tenant).order_by(Schedule.name))
    )


def get_schedule(session: Session, tenant: str, name: str) -> Schedule:
    schedule = session.scalar(
        select(Schedule).where(Schedule.tenant == tenant, Schedule.name == name)
    )
    if schedule is None:
        raise NotFoundError(f"There is no schedule {name!r}.")
    return schedule


def remove_schedule(session: Session, tenant: str, name: str) -> None:
    with unit_of_work(session):
        session.delete(get_schedule(session, tenant, name))


def run_due(session: Session, dispatcher: Dispatcher, now: datetime | None = None) -> list[str]:
    """Start every due schedule's run (jobs started, by id), in the order they fell due. A
    schedule whose previous run is still going is skipped until its next time: never two runs
    at once."""
    now = now or utcnow()
    due = session.scalars(
        select(Schedule.id).where(Schedule.next_run_at <= now).order_by(Schedule.next_run_at)
    ).all()
    started = [_run(session, dispatcher, schedule_id, now) for schedule_id in due]
    return [job_id for job_id in started if job_id is not None]


@traced("kiln.bulk.submit")
def _run(session: Session, dispatcher: Dispatcher, schedule_id: int, now: datetime) -> str | None:
    """One unit of work: the schedule advanced to its next time, and its run's job (unless it
    cannot start now), committed together; then the job's ingest message."""
    with unit_of_work(session):
        schedule = _lock_if_due(session, schedule_id, now)
        if schedule is None:  # another beat has it (a mistake, but it happens), or ran it
            return None
        schedule.next_run_at = next_run(schedule.cron, now)
        job = _stage_run(session, schedule)
        if job is None:
            return None
        schedule.last_job_id = job.id
    start_ingest(session, dispatcher, job)
    log.info("schedule %s/%s started job %s", schedule.tenant, schedule.name, job.id)
    return job.id


def _lock_if_due(session: Session, schedule_id: int, now: datetime) -> Schedule | None:
    """The schedule, locked for this unit, if still due; SKIP LOCKED, so two beats cannot both
    start the same run."""
    query = select(Schedule).where(Schedule.id == schedule_id, Schedule.next_run_at <= now)
    if on_postgres(session):
        query = query.with_for_update(skip_locked=True)
    return session.scalar(query.execution_options(populate_existing=True))


def _stage_run(session: Session, schedule: Schedule) -> Job | None:
    """The run's bulk job, staged in the caller's unit; None (logged) when it cannot start."""
    where = f"{schedule.tenant}/{schedule.name}"
    try:
        return stage_bulk(session, _request(schedule))
    except ConflictError as error:  # the previous run is still going
        log.warning("schedule %s skipped: %s", where, error)
    except (InputError, ForbiddenError) as error:  # model removed, bucket denied: next time
        log.warning("schedule %s cannot run: %s", where, error)
    return None


def _request(schedule: Schedule) -> BulkRequest:
    return BulkRequest(
        tenant=schedule.tenant,
        model=schedule.model,
        source=Source.from_json(schedule.source),
        pipeline=schedule.name,
        output=schedule.output,
        options=dict(schedule.options or {}),
        retry_failed=schedule.retry_failed,
        schedule=schedule.name,
    )
