"""/healthz (process up) and /readyz (database, broker and storage reachable)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from kiln.app.api.deps import ContextDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(context: ContextDep) -> JSONResponse:
    checks: dict[str, str] = {}
    try:
        with context.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as error:
        checks["database"] = f"unreachable: {type(error).__name__}"
    try:
        with context.celery.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
        checks["broker"] = "ok"
    except Exception as error:
        checks["broker"] = f"unreachable: {type(error).__name__}"
    try:
        context.store.ping()
        checks["storage"] = "ok"
    except Exception as error:
        checks["storage"] = f"unreachable: {type(error).__name__}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)
