"""Chunk runs in progress: each worker's lease keeper upserts, every tick, how many rows each of
its runs has answered but not yet written; a run's row goes with its results (the same unit of
work), and the reconciler deletes rows no keeper has touched for a while (a worker that died).
A job's progress reads them, so it moves between its chunks' commits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ScalarSelect, delete, func, select, update
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db.models import ChunkRun, aware, utcnow
from kiln.app.jobs.throughput import Span


@dataclass(frozen=True)
class RunTally:
    """One run as its keeper sees it."""

    owner: str
    job_id: str
    answered: int
    started_at: datetime


@dataclass(frozen=True)
class InFlight:
    """A job's live runs together: rows answered and not yet written, and each run's answered
    rows as worked from its start to now (for the job's rate, `throughput`)."""

    answered: int = 0
    spans: tuple[Span, ...] = ()


def publish(session: Session, runs: Sequence[RunTally]) -> None:
    """Upsert every run's tally in one statement."""
    if not runs:
        return
    now = utcnow()
    rows = [
        {"owner": r.owner, "job_id": r.job_id, "answered": r.answered,
         "started_at": r.started_at, "updated_at": now}
        for r in runs
    ]  # fmt: skip
    statement = dialect.insert(session, ChunkRun)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[ChunkRun.owner],
            set_={
                "answered": statement.excluded.answered,
                "updated_at": statement.excluded.updated_at,
            },
        ),
        rows,
    )


def touch(session: Session, owners: Sequence[str]) -> None:
    """Runs writing their results: still alive, their rows as they are. An update, not an
    upsert: a row its run's write has deleted meanwhile stays deleted."""
    if owners:
        session.execute(
            update(ChunkRun).where(ChunkRun.owner.in_(list(owners))).values(updated_at=utcnow())
        )


def forget(session: Session, owners: Sequence[str]) -> None:
    """Runs that ended (their results are written, or they gave their items back)."""
    if owners:
        session.execute(delete(ChunkRun).where(ChunkRun.owner.in_(list(owners))))


def answered_sum(job_id: str, fresh_since: datetime) -> ScalarSelect[int]:
    """The rows the job's live runs (touched since `fresh_since`) answered, as a subquery to
    read in the same statement as the job's counters (`counters.read_with`)."""
    return (
        select(func.coalesce(func.sum(ChunkRun.answered), 0))
        .where(ChunkRun.job_id == job_id, ChunkRun.updated_at >= fresh_since)
        .scalar_subquery()
    )


def in_flight(session: Session, job_id: str, fresh_since: datetime) -> InFlight:
    """The job's runs touched since `fresh_since` (older ones belong to a worker that stopped)."""
    rows = session.execute(
        select(ChunkRun.answered, ChunkRun.started_at).where(
            ChunkRun.job_id == job_id, ChunkRun.updated_at >= fresh_since
        )
    ).all()
    now = utcnow().timestamp()
    spans = tuple(Span(min(now, _epoch(started, now)), now, int(count)) for count, started in rows)
    return InFlight(sum(span.items for span in spans), spans)


def _epoch(stamp: datetime | None, default: float) -> float:
    moment = aware(stamp)
    return moment.timestamp() if moment is not None else default


def purge(session: Session, older_than: datetime) -> int:
    """Rows of runs no keeper has renewed since `older_than`."""
    result = session.execute(delete(ChunkRun).where(ChunkRun.updated_at < older_than))
    return int(result.rowcount)  # type: ignore[attr-defined]
