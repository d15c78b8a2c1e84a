"""The exit status of a job a command waited for (`kiln run`, `submit --wait`, `status
--watch`, `bulk --watch`), decided in one place so a cron wrapper reads them all alike:

- 1: the job failed, or was cancelled; a bucket source matched no object at all (a mistyped
  prefix or filter); or items ran and none succeeded;
- 0: anything else, failed items and all (the results say why each failed) — among them a
  pipeline's run with nothing new, whose only failures are the known ones it kept.

Pure: the callers print the sentence (and, for "no item succeeded", the first item's error).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    COMPLETED = "completed"
    NOTHING_NEW = "nothing new"  # a pipeline's run: every object unchanged or a known failure
    FAILED = "failed"  # the job itself failed (its `error` says why)
    CANCELLED = "cancelled"
    MATCHED_NOTHING = "matched nothing"  # a bucket source: no object passed prefix and filters
    NONE_SUCCEEDED = "none succeeded"


@dataclass(frozen=True)
class Ended:
    """What a waited-for job ended as: its status and counts, and a bulk job's source."""

    status: str
    total: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    error: str | None = None
    source: dict[str, Any] | None = None  # a bulk job's: {s3, include, exclude, case_sensitive}
    skipped: int = 0
    known_failed: int = 0
    excluded: int = 0
    deleted: int = 0

    @classmethod
    def of_job(cls, job: dict[str, Any]) -> Ended:
        """From the API's answer for a job."""
        c: dict[str, Any] = job["counts"]
        return cls(
            status=job["status"],
            total=c["total"],
            succeeded=c["succeeded"],
            failed=c["failed"],
            cancelled=c.get("cancelled", 0),
            error=job.get("error"),
            source=job.get("source"),
            skipped=c.get("skipped", 0),
            known_failed=c.get("known_failed", 0),
            excluded=c.get("excluded", 0),
            deleted=c.get("deleted", 0),
        )


@dataclass(frozen=True)
class Verdict:
    code: int
    kind: Kind
    sentence: str | None = None  # why (stderr) when code is 1; a note (stdout) when 0
    first_error: bool = False  # the caller adds the first item's error


def decide(ended: Ended, results: str | None = None) -> Verdict:
    """The exit status and its sentence. `results`: where each item's error can be read (a
    local run's file), said when no item succeeded."""
    if ended.status == "failed":
        return Verdict(1, Kind.FAILED, f"the job failed: {ended.error}")
    if ended.status == "cancelled":
        said = f"The job was cancelled: {ended.succeeded} items succeeded before it was."
        return Verdict(1, Kind.CANCELLED, said)
    if ended.source is not None and ended.total == 0:
        if ended.skipped + ended.known_failed == 0:
            return Verdict(1, Kind.MATCHED_NOTHING, matched_nothing(ended))
        return Verdict(0, Kind.NOTHING_NEW, nothing_new(ended))
    if ended.succeeded == 0 and ended.failed:
        where = f" of {ended.total} failed; each error is in {results}" if results else " failed"
        kept = f"; {_known(ended.known_failed)} kept" if ended.known_failed else ""
        said = f"no item succeeded ({ended.failed}{where}{kept})."
        return Verdict(1, Kind.NONE_SUCCEEDED, said, first_error=True)
    return Verdict(0, Kind.COMPLETED)


def nothing_new(ended: Ended) -> str:
    """`nothing new; 11 known failures kept, 1386 unchanged` (and the deleted objects, when
    there are)."""
    parts = [_known(ended.known_failed) + " kept"] if ended.known_failed else []
    if ended.skipped:
        parts.append(f"{ended.skipped} unchanged")
    if ended.deleted:
        parts.append(f"{ended.deleted} deleted")
    again = " (--retry-failed runs the known failures again)" if ended.known_failed else ""
    return "nothing new; " + ", ".join(parts) + again


def matched_nothing(ended: Ended) -> str:
    """`s3://photos/2026/ with --include '*.jpg' matched no object (40 listed, 40 left out
    by the filters).`"""
    source = ended.source or {}
    where = str(source.get("s3", "The source"))
    flags = [f"--include {shlex.quote(p)}" for p in source.get("include", [])]
    flags += [f"--exclude {shlex.quote(p)}" for p in source.get("exclude", [])]
    if flags and source.get("case_sensitive"):
        flags.append("--case-sensitive")
    if flags:
        where += " with " + " ".join(flags)
    if ended.excluded:
        listed = f"{ended.excluded} listed, {ended.excluded} left out by the filters"
        return f"{where} matched no object ({listed})."
    gone = f" (the pipeline's {ended.deleted} objects are gone)" if ended.deleted else ""
    return f"{where} matched no object: nothing is listed under that prefix{gone}."


def _known(n: int) -> str:
    return f"{n} known failure{'' if n == 1 else 's'}"
