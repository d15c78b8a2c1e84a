"""Kiln's error taxonomy: one base, split by what the caller should do about it."""

from __future__ import annotations


class KilnError(Exception):
    """Base of every error Kiln raises on purpose; `str()` is a sentence for humans."""


class TransientError(KilnError):
    """A fault that may pass (throttling, a restarting database): retry with backoff."""


class SetupError(TransientError):
    """Kiln's own setup is wrong: its storage bucket missing, its credentials refused. Not the
    caller's fault: the API answers 503 with the sentence, and a task retries it as it does any
    transient fault (no item fails for it), so the work resumes once an operator fixes it."""


class InputError(KilnError):
    """The input itself is bad: fail that item (or request) with this sentence."""


class OutputError(InputError):
    """The job's output (the user's `s3://` prefix for its results) cannot be written for a
    reason retrying cannot fix: its bucket is missing, refuses Kiln, or is no bucket name. At
    submission a 422; in a worker the job fails at once with this sentence (no retry, no
    re-run of inference it could not store)."""


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


def plain_reason(error: BaseException) -> str:
    """A driver's own words for a failure, its first line without boilerplate, for a sentence:
    `Connection refused`, `database "kiln" does not exist` (psycopg, kombu, botocore)."""
    lines = str(getattr(error, "orig", None) or error).strip().splitlines()
    first = lines[0] if lines else ""
    if "connection to server" in first:  # psycopg: 'connection failed: connection to server…'
        first = first.rpartition(" failed: ")[2]
    return first.replace("FATAL:", "").strip().rstrip(".") or type(error).__name__
