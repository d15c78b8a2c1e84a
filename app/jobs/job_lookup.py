"""Finding a tenant's job again by its id or the first characters of it (the eight the CLI's
bars and the console show). Reads only: the caller owns the transaction."""

from __future__ import annotations

import re

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.db import queries
from kiln.app.db.models import Job, Pipeline

MIN_PREFIX = 4  # fewer characters would name most of a busy tenant's jobs at once
NAMED_MATCHES = 3  # an ambiguous prefix's sentence names this many of the jobs it matches
ID_CHARACTERS = re.compile(r"[0-9a-f-]+")  # job ids are UUIDs: str(uuid.uuid4())


def find_job(session: Session, tenant: str, given: str) -> Job:
    """The tenant's job whose id is `given`, or the only one whose id starts with it (at least
    MIN_PREFIX characters, any case). NotFoundError: none (another tenant's job included);
    InputError: more than one, with how many and which."""
    job = queries.tenant_job(session, tenant, given)
    if job is not None:
        return job
    prefix = given.lower()
    if not ID_CHARACTERS.fullmatch(prefix):
        raise NotFoundError(f"There is no job {given}.")
    if len(prefix) < MIN_PREFIX:
        raise NotFoundError(
            f"There is no job {given}; name a job by its id or at least {MIN_PREFIX} of its "
            "first characters."
        )
    starting = Job.tenant == tenant, Job.id.like(f"{prefix}%")  # no `%` or `_` in a prefix
    ids = session.scalars(select(Job.id).where(*starting).order_by(Job.id).limit(2)).all()
    if not ids:
        raise NotFoundError(f"There is no job {given}.")
    if len(ids) == 1:
        job = session.get(Job, ids[0])
        assert job is not None
        return job
    raise InputError(_ambiguous(session, given, starting))


def _ambiguous(session: Session, given: str, starting: tuple[ColumnElement[bool], ...]) -> str:
    count = session.scalar(select(func.count()).select_from(Job).where(*starting)) or 0
    named = session.scalars(
        select(Job.id).where(*starting).order_by(Job.id).limit(NAMED_MATCHES)
    ).all()
    more = ", …" if count > len(named) else ""
    return (
        f"{count} of your jobs have an id starting with {given} ({', '.join(named)}{more}); "
        "give more of it."
    )


def pipeline_name(session: Session, job: Job) -> str | None:
    """The name of the pipeline the job is a run of (read once per session: the identity map
    keeps it for the other runs on a page)."""
    if job.pipeline_id is None:
        return None
    pipeline = session.get(Pipeline, job.pipeline_id)
    return pipeline.name if pipeline is not None else None
