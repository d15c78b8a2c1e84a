"""Kiln from Python: `kiln.Client` (blocking) and `kiln.AsyncClient` (asyncio) over the HTTP
API, typed with the API's own response models, errors raised as `kiln.ApiError` carrying the
API's sentence. Imports no server code: only the API's schemas (pydantic) and httpx."""

from kiln.app.api.schemas import (
    DeliveryOut,
    EstimateOut,
    ItemOut,
    JobOut,
    NotifyIn,
    NotifyOut,
    ResultUrlsOut,
    SearchOut,
)
from kiln.app.client.async_client import AsyncClient
from kiln.app.client.errors import (
    ApiError,
    AuthError,
    ConflictError,
    ConnectionFailedError,
    InvalidRequestError,
    JobTimeoutError,
    NotFoundError,
    RateLimitedError,
    UnavailableError,
)
from kiln.app.client.sync import Client

__all__ = [
    "ApiError",
    "AsyncClient",
    "AuthError",
    "Client",
    "ConflictError",
    "ConnectionFailedError",
    "DeliveryOut",
    "EstimateOut",
    "InvalidRequestError",
    "ItemOut",
    "JobOut",
    "JobTimeoutError",
    "NotFoundError",
    "NotifyIn",
    "NotifyOut",
    "RateLimitedError",
    "ResultUrlsOut",
    "SearchOut",
    "UnavailableError",
]
