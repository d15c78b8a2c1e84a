"""Every error leaves the API as a status code and one sentence, never a traceback."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DataError, OperationalError, ProgrammingError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException

from kiln.app.api.schemas import MALFORMED_BODY, ErrorOut
from kiln.app.core.errors import (
    ConflictError,
    ForbiddenError,
    InputError,
    KilnError,
    LimitExceededError,
    NotFoundError,
    TransientError,
)

log = logging.getLogger(__name__)


class RequestTooLargeError(InputError):
    """The body or one file is over the configured limit."""


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """A route's documented error answers (OpenAPI `responses`): each is `ErrorOut`, one
    sentence; 400 is described as a body Kiln cannot parse."""
    return {code: MALFORMED_BODY if code == 400 else {"model": ErrorOut} for code in sorted(codes)}


_STATUS: list[tuple[type[KilnError], int]] = [
    (RequestTooLargeError, status.HTTP_413_CONTENT_TOO_LARGE),
    (ForbiddenError, status.HTTP_403_FORBIDDEN),
    (NotFoundError, status.HTTP_404_NOT_FOUND),
    (ConflictError, status.HTTP_409_CONFLICT),
    (InputError, status.HTTP_422_UNPROCESSABLE_CONTENT),
    (TransientError, status.HTTP_503_SERVICE_UNAVAILABLE),
    (LimitExceededError, status.HTTP_429_TOO_MANY_REQUESTS),
]


def validation_sentence(errors: Sequence[Any]) -> str:
    parts = []
    for error in errors[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body",))
        parts.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return "The request is not valid: " + "; ".join(parts) + "."


def http_sentence(request: Request, error: HTTPException) -> str:
    """The error's own detail, or a sentence instead of Starlette's bare phrase ("Not Found")."""
    detail = str(error.detail)
    if detail != HTTPStatus(error.status_code).phrase:
        return detail if detail.endswith((".", "?", "!")) else f"{detail}."
    where = f"{request.method} {request.url.path}"
    if error.status_code == status.HTTP_404_NOT_FOUND:
        return f"There is no route for {where}; the routes are listed at /docs."
    if error.status_code == status.HTTP_405_METHOD_NOT_ALLOWED:
        return f"{request.url.path} does not take {request.method}; the routes are listed at /docs."
    return f"The request {where} failed: {detail.lower()}."


def _answer(
    request: Request,
    code: int,
    sentence: str,
    error: Exception,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """`{"detail": sentence}` — or an HTML page where the app has one for this request (the
    console's routes: `app.state.error_page` answers None for the API's)."""
    error_page = getattr(request.app.state, "error_page", None)
    page = error_page(request, code, sentence, error) if error_page else None
    if page is not None:
        return page  # type: ignore[no-any-return]
    return JSONResponse({"detail": sentence}, status_code=code, headers=headers)


def _kiln_headers(code: int, error: KilnError) -> dict[str, str] | None:
    if isinstance(error, LimitExceededError):
        return {"Retry-After": str(error.retry_after)}
    return {"Retry-After": "5"} if code == 503 else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, error: KilnError) -> Response:
        code = next((c for kind, c in _STATUS if isinstance(error, kind)), 500)
        return _answer(request, code, str(error), error, _kiln_headers(code, error))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Response:
        sentence = validation_sentence(error.errors())
        return _answer(request, status.HTTP_422_UNPROCESSABLE_CONTENT, sentence, error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        sentence = http_sentence(request, error)
        return _answer(request, error.status_code, sentence, error, error.headers)

    @app.exception_handler(DataError)
    async def unstorable(request: Request, error: DataError) -> JSONResponse:
        # What passed validation but the database refuses: a NUL character, an infinite number.
        log.info("refused data on %s %s: %s", request.method, request.url.path, error.orig)
        sentence = (
            "The request holds a value Kiln cannot store "
            "(a NUL character in a string, or a number that is not finite)."
        )
        return JSONResponse({"detail": sentence}, status_code=status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeoutError)
    @app.exception_handler(ProgrammingError)
    async def database_down(request: Request, error: Exception) -> JSONResponse:
        log.warning("database error on %s %s: %s", request.method, request.url.path, error)
        if _schema_missing(error):  # a setup step not taken: what /readyz says, here too
            return JSONResponse(
                {"detail": SCHEMA_MISSING}, status_code=status.HTTP_503_SERVICE_UNAVAILABLE
            )
        if isinstance(error, ProgrammingError):  # Kiln's own SQL: a bug, not the database
            return _internal(request)
        return JSONResponse(
            {"detail": "The database is busy or unreachable; retry shortly."},
            status_code=status.HTTP_503_SERVICE_UNAVAILABLE,
            headers={"Retry-After": "2"},
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return _internal(request)


SCHEMA_MISSING = (
    "The database does not have this Kiln's tables (or has older ones): run `kiln db upgrade`."
)


def _schema_missing(error: Exception) -> bool:
    """A table or column Kiln's schema has is not there: PostgreSQL's undefined_table and
    undefined_column (SQLSTATE 42P01, 42703), SQLite's "no such table/column" and "table T has
    no column named C"."""
    orig = getattr(error, "orig", None)
    if getattr(orig, "sqlstate", None) in ("42P01", "42703"):
        return True
    said = str(orig)
    return said.startswith(("no such table", "no such column")) or " has no column named " in said


def _internal(request: Request) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse(
        {"detail": "Kiln hit an internal error; it has been logged."},
        status_code=status.HTTP_500_INTERNAL_SERVER_ERROR,
    )
