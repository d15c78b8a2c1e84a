"""Schedules: cron-timed runs of an incremental pipeline, started by `kiln beat`."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime

from croniter import CroniterBadCronError, croniter
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.app.catalog import get_model
from kiln.app.core.errors import ConflictError, ForbiddenError, InputError, NotFoundError
from kiln.app.db.models import Schedule, utcnow
from kiln.app.dispatch.contract import Dispatcher
from kiln.app.ingest import (
    NAME_PATTERN,
    BulkRequest,
    Source,
    check_places,
    submit_bulk,
)
from kiln.app.storage.s3 import parse_s3_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScheduleRequest:
    tenant: str
    name: str
    cron: str
    source: Source
    model: str
    output: str | None = None


def next_run(cron: str, after: datetime) -> datetime:
    """The first time after `after` that `cron` (five fields, UTC) names."""
    try:
        return croniter(cron, after).get_next(datetime)
    except (CroniterBadCronError, ValueError, KeyError):
        raise InputError(
            f"{cron!r} is not a cron expression like '0 2 * * *' (minute hour day month weekday)."
        ) from None


def add_schedule(session: Session, request: ScheduleRequest) -> Schedule:
    if not re.fullmatch(NAME_PATTERN, request.name):
        raise InputError("A schedule name is letters, digits, '.', '_' or '-' (up to 128).")
    if len(request.cron.split()) != 5:
        raise InputError("A cron expression has five fields: minute hour day month weekday.")
    when = next_run(request.cron, utcnow())
    request.source.check()
    if request.output:
        parse_s3_uri(request.output)
    try:
        get_model(session, request.model, request.tenant)
    except NotFoundError as error:
        raise InputError(str(error)) from None
    check_places(session, request.tenant, request.source, request.output)
    schedule = Schedule(
        tenant=request.tenant,
        name=request.name,
        cron=request.cron,
        source=request.source.to_json(),
        model=request.model,
        output=request.output,
        next_run_at=when,
    )
    session.add(schedule)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
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
    session.delete(get_schedule(session, tenant, name))
    session.commit()


def run_due(session: Session, dispatcher: Dispatcher, now: datetime | None = None) -> list[str]:
    """Start every due schedule's run (jobs started, by id). A schedule whose previous run is
    still going is skipped until its next time: never two runs at once.

    Due rows are locked with SKIP LOCKED, so two beats (a mistake, but it happens) cannot both
    start the same run.
    """
    now = now or utcnow()
    query = select(Schedule).where(Schedule.next_run_at <= now).order_by(Schedule.next_run_at)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    started: list[str] = []
    for schedule in session.scalars(query).all():
        schedule.next_run_at = next_run(schedule.cron, now)
        try:
            submitted = submit_bulk(session, dispatcher, _request(schedule))
        except ConflictError as error:  # the previous run is still going
            log.warning("schedule %s/%s skipped: %s", schedule.tenant, schedule.name, error)
            session.rollback()
            _advance(session, schedule.id, now)
            continue
        except (InputError, ForbiddenError) as error:  # model removed, bucket denied: next time
            log.warning("schedule %s/%s cannot run: %s", schedule.tenant, schedule.name, error)
            session.rollback()
            _advance(session, schedule.id, now)
            continue
        schedule.last_job_id = submitted.job.id
        session.commit()
        started.append(submitted.job.id)
        log.info("schedule %s/%s started job %s", schedule.tenant, schedule.name, submitted.job.id)
    session.commit()
    return started


def _advance(session: Session, schedule_id: int, now: datetime) -> None:
    schedule = session.get(Schedule, schedule_id)
    if schedule is not None:
        schedule.next_run_at = next_run(schedule.cron, now)
        session.commit()


def _request(schedule: Schedule) -> BulkRequest:
    return BulkRequest(
        tenant=schedule.tenant,
        model=schedule.model,
        source=Source.from_json(schedule.source),
        pipeline=schedule.name,
        output=schedule.output,
    )
