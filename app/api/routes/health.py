"""/healthz (process up) and /readyz (database, broker and storage reachable and usable)."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from kiln.app.api.context import ApiContext
from kiln.app.api.deps import ContextDep
from kiln.app.core.config import redact_url
from kiln.app.core.errors import KilnError, plain_reason
from kiln.app.db.migrate import schema_problem

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)

OK = "ok"


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": OK}


def _database(context: ApiContext) -> str:
    where = context.engine.url.render_as_string(hide_password=True)
    try:
        with context.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
            problem = schema_problem(connection)
    except Exception as error:
        log.warning("readyz: the database at %s: %s", where, error)
        return f"The database at {where} cannot be reached: {plain_reason(error)}."
    return problem or OK


def _broker(context: ApiContext) -> str:
    where = redact_url(str(context.celery.conf.broker_url))
    try:
        with context.celery.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
    except Exception as error:
        log.warning("readyz: the broker at %s: %s", where, error)
        return f"The broker at {where} cannot be reached: {plain_reason(error)}."
    return OK


def _storage(context: ApiContext) -> str:
    try:
        context.store.ping()
    except KilnError as error:  # a sentence already: "Kiln's storage bucket … does not exist"
        log.warning("readyz: %s", error)
        return str(error)
    except Exception as error:
        log.warning("readyz: the store: %s", error)
        return (
            f"Kiln's store ({context.settings.storage_url}) cannot be used: {plain_reason(error)}."
        )
    return OK


@router.get("/readyz")
def readyz(context: ContextDep) -> JSONResponse:
    """Each check answers "ok" or a sentence naming what is wrong; 503 unless all are ok."""
    checks = {
        "database": _database(context),
        "broker": _broker(context),
        "storage": _storage(context),
    }
    ready = all(v == OK for v in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)
