"""What the client raises: one base, `ApiError`, carrying the API's sentence and status, and a
subclass per answer a caller may want to treat on its own (404, 409, 422, 429, 503, …)."""

from __future__ import annotations

import httpx

from kiln.app.core.errors import KilnError


class ApiError(KilnError):
    """The API refused or failed a request. `str()` is its sentence and status; `detail` is the
    sentence alone, `status` the HTTP status (None: the API could not be reached)."""

    def __init__(self, detail: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(detail if status is None else f"{detail} (HTTP {status})")
        self.detail = detail
        self.status = status
        self.retry_after = retry_after


class ConnectionFailedError(ApiError):
    """The API did not answer at all: not running there, or the network between is down."""


class AuthError(ApiError):
    """401 or 403: the key is unknown or revoked, or may not do this."""


class InvalidRequestError(ApiError):
    """400, 413 or 422: the request itself is wrong; `detail` says what to change."""


class NotFoundError(ApiError):
    """404: no such job (or model, pipeline, schedule) for this tenant."""


class ConflictError(ApiError):
    """409: the request contradicts the current state (e.g. cancelling a finished job)."""


class RateLimitedError(ApiError):
    """429: over a rate or quota; `retry_after` says how many seconds to wait."""


class UnavailableError(ApiError):
    """503: not ready yet, or a dependency of the API is down; worth asking again later."""


class JobTimeoutError(TimeoutError):
    """`wait()` ran out of time before the job closed; `job` is the last answer seen."""

    def __init__(self, message: str, job: object) -> None:
        super().__init__(message)
        self.job = job


_BY_STATUS: dict[int, type[ApiError]] = {
    400: InvalidRequestError,
    401: AuthError,
    403: AuthError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    429: RateLimitedError,
    503: UnavailableError,
}


def error_for(response: httpx.Response) -> ApiError:
    """The exception for an error answer: its class by status, its sentence from `detail`."""
    try:
        body = response.json()
        detail = body.get("detail", response.text) if isinstance(body, dict) else response.text
    except ValueError:  # not JSON: a proxy's page, say
        detail = response.text.strip() or response.reason_phrase
    kind = _BY_STATUS.get(response.status_code, ApiError)
    return kind(str(detail), response.status_code, _retry_after(response))


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        return None


def unreachable(base_url: object, error: Exception) -> ConnectionFailedError:
    return ConnectionFailedError(
        f"Could not reach the Kiln API at {base_url} (KILN_API_URL): {error}. "
        "Is `kiln api` running there?"
    )
