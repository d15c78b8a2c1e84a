"""/v1/schedules: cron-timed incremental runs over a bucket, started by `kiln beat`."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from kiln.app.api.deps import S3Dep, SessionDep, TenantDep
from kiln.app.api.errors import error_responses
from kiln.app.api.schemas import ScheduleCreate, ScheduleOut
from kiln.app.db.models import Schedule
from kiln.app.jobs import schedules
from kiln.app.jobs.ingest import Source

router = APIRouter(prefix="/v1/schedules", tags=["schedules"])

ERRORS = error_responses(401, 403, 404, 409, 422, 429, 503)


def schedule_out(schedule: Schedule) -> ScheduleOut:
    return ScheduleOut.model_validate(schedule)


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ScheduleOut,
    responses={**ERRORS, **error_responses(400)},
)
def create_schedule(
    body: ScheduleCreate, session: SessionDep, tenant: TenantDep, s3: S3Dep
) -> ScheduleOut:
    """Run `model` over `source` at each `cron` time (UTC), incrementally: each run processes
    only new or changed objects. A run never starts while the previous one is going."""
    given = body.source
    source = Source(given.s3, tuple(given.include), tuple(given.exclude), given.case_sensitive)
    request = schedules.ScheduleRequest(
        tenant, body.name, body.cron, source, body.model, body.output, body.options,
        body.retry_failed,
    )  # fmt: skip
    return schedule_out(schedules.add_schedule(session, request, s3=s3))


@router.get("", response_model=list[ScheduleOut], responses=ERRORS)
def list_schedules(session: SessionDep, tenant: TenantDep) -> list[ScheduleOut]:
    """Your schedules, by name."""
    return [schedule_out(s) for s in schedules.list_schedules(session, tenant)]


@router.get("/{name}", response_model=ScheduleOut, responses=ERRORS)
def get_schedule(name: str, session: SessionDep, tenant: TenantDep) -> ScheduleOut:
    return schedule_out(schedules.get_schedule(session, tenant, name))


@router.delete(
    "/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response, responses=ERRORS
)
def delete_schedule(name: str, session: SessionDep, tenant: TenantDep) -> Response:
    """Stop scheduling; runs already started go on."""
    schedules.remove_schedule(session, tenant, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)
