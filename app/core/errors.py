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
