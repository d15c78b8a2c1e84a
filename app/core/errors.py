"""Kiln's error taxonomy: one base, split by what the caller should do about it."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose; `str()` is a sentence for humans."""


class TransientError(KilnError):
    """A fault that may pass (throttling, a restarting database): retry with backoff."""


class InputError(KilnError):
    """The input itself is bad: fail that item (or request) with this sentence."""


class NotFoundError(KilnError):
    """The thing asked for does not exist for this tenant."""


class ConflictError(KilnError):
    """The request contradicts the current state (e.g. cancelling a finished job)."""


class ForbiddenError(KilnError):
    """The tenant may not do this (e.g. read a bucket not on its allow-list)."""


class LimitExceededError(KilnError):
    """The tenant is over a rate or quota; `retry_after` says how many seconds to wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = max(1, retry_after)
