"""Kiln: queue-driven batch inference.

The one import name of the distribution. Its subpackages are the repository's top-level folders
(`kiln/app` → `app/`, `kiln/workers` → `workers/`, `kiln/migrations` → `migrations/`, linked so
the layout stays as the product is known by while nothing generic lands on a user's `sys.path`).

From Python: `from kiln import Client` (or `AsyncClient`, `ApiError`, …). They are loaded on
first use (a module `__getattr__`), so `import kiln` stays cheap for the CLI and the workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.app.client import (
        ApiError,
        AsyncClient,
        AuthError,
        Client,
        ConflictError,
        ConnectionFailedError,
        DeliveryOut,
        EstimateOut,
        InvalidRequestError,
        ItemOut,
        JobOut,
        JobTimeoutError,
        NotFoundError,
        NotifyIn,
        NotifyOut,
        RateLimitedError,
        ResultUrlsOut,
        SearchOut,
        UnavailableError,
    )

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


def __getattr__(name: str) -> Any:
    """The public client's names, imported when first asked for."""
    if name in __all__:
        from kiln.app import client

        value = getattr(client, name)
        globals()[name] = value  # asked once: later lookups skip this function
        return value
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
