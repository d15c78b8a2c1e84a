"""A job's item counts, kept as it runs (the `job_counters` table) and checked against its items.

Counting a job's items on every poll grows with the job; adding to a counter as items change
does not. Each change to an item's final status is added in the same transaction as the
change itself, to slot `chunk % COUNTER_SLOTS` of the job, so workers finishing chunks of one
job at once rarely touch the same row. `recount` counts the items themselves: the check that
counters never drift (`kiln admin recount`, and the tests). Never commits: the caller owns the
transaction.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import ColumnElement, Executable, bindparam, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db.models import COUNTER_SLOTS, Item, ItemStatus, JobCounter

FINAL = (ItemStatus.SUCCEEDED, ItemStatus.FAILED, ItemStatus.CANCELLED)
COUNTED = ("total", "succeeded", "failed", "cancelled", "fell_back", "fell_back_succeeded")


@dataclass(frozen=True)
class Tally:
    """A job's items: how many in all, and how many ended each way (the rest are open)."""

    total: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    fell_back: int = 0  # items the job's fallback model took (also counted by their status)
    fell_back_succeeded: int = 0  # of those, the items it answered

    @property
    def open(self) -> int:
        return self.total - self.succeeded - self.failed - self.cancelled


def slot_of(chunk: int) -> int:
    return chunk % COUNTER_SLOTS


def add(session: Session, job_id: str, slot: int, delta: Tally) -> None:
    """Add `delta` to one slot of the job's counters (creating the row on first use)."""
    if delta == Tally():
        return
    postgres = dialect.on_postgres(session)
    session.execute(_add_statement(postgres), {"job_id": job_id, "slot": slot, **_columns(delta)})


@functools.cache
def _add_statement(postgres: bool) -> Executable:
    """The upsert `add` runs, built once per dialect with its values as bound parameters:
    building it (its `excluded` alias above all) cost a chunk's write about a millisecond."""
    insert = postgresql.insert if postgres else sqlite.insert
    names = ("job_id", "slot", *COUNTED)
    statement = insert(JobCounter).values({name: bindparam(name) for name in names})
    return statement.on_conflict_do_update(
        index_elements=[JobCounter.job_id, JobCounter.slot],
        set_={name: getattr(JobCounter, name) + statement.excluded[name] for name in COUNTED},
    )


def ended(statuses: Iterable[str], fell_back: Iterable[str] = ()) -> Tally:
    """The counter change for items that just reached these final statuses; `fell_back`: the
    statuses of those among them that the job's fallback model took."""
    by_status = Counter(str(s) for s in statuses)
    fallen = Counter(str(s) for s in fell_back)
    return Tally(
        succeeded=by_status[ItemStatus.SUCCEEDED],
        failed=by_status[ItemStatus.FAILED],
        cancelled=by_status[ItemStatus.CANCELLED],
        fell_back=fallen.total(),
        fell_back_succeeded=fallen[ItemStatus.SUCCEEDED],
    )


def read(session: Session, job_id: str) -> Tally:
    """The job's counts: a sum over at most COUNTER_SLOTS rows."""
    return read_with(session, job_id, literal(0))[0]


def read_with(session: Session, job_id: str, beside: ColumnElement[int]) -> tuple[Tally, int]:
    """The job's counts and `beside` (a scalar subquery) in one statement: one snapshot, so a
    transaction that moves rows between the two is seen wholly or not at all."""
    row = session.execute(
        select(*sums(), beside.label("beside")).where(JobCounter.job_id == job_id)
    ).one()
    *counted, other = row
    return Tally(*(int(n) for n in counted)), int(other or 0)


def sums() -> list[ColumnElement[int]]:
    """The counted columns summed over the rows selected (a job's slots: the caller's WHERE),
    in `Tally`'s order, each labelled by its name: `Tally(*row)` reads them back."""
    return [func.coalesce(func.sum(getattr(JobCounter, name)), 0).label(name) for name in COUNTED]


def recount(session: Session, job_id: str) -> Tally:
    """The job's counts from its items (a scan of the job): what the counters must equal."""
    rows = session.execute(
        select(Item.status, func.count(), func.count(Item.fallback_reason))  # non-null ones
        .where(Item.job_id == job_id)
        .group_by(Item.status)
    ).all()
    by_status = {str(status): int(n) for status, n, _fell in rows}
    fell_back = {str(status): int(fell) for status, _n, fell in rows}
    return Tally(
        total=sum(by_status.values()),
        succeeded=by_status.get(ItemStatus.SUCCEEDED, 0),
        failed=by_status.get(ItemStatus.FAILED, 0),
        cancelled=by_status.get(ItemStatus.CANCELLED, 0),
        fell_back=sum(fell_back.values()),
        fell_back_succeeded=fell_back.get(ItemStatus.SUCCEEDED, 0),
    )


def difference(session: Session, job_id: str) -> Tally:
    """What the counters lack against the items (all zero when they agree)."""
    truth, kept = recount(session, job_id), read(session, job_id)
    return Tally(*(getattr(truth, name) - getattr(kept, name) for name in COUNTED))


def repair(session: Session, job_id: str) -> Tally:
    """Make the counters equal the items again (slot 0 takes the difference); returns what
    was added. Both reads must see one snapshot (`snapshot`), or a chunk finishing between
    them looks like drift."""
    missing = difference(session, job_id)
    add(session, job_id, 0, missing)
    return missing


def snapshot(session: Session) -> None:
    """Make the session's transaction read one snapshot (Postgres: REPEATABLE READ; SQLite's
    transactions already do). Call first in the transaction."""
    if dialect.on_postgres(session):
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})


def _columns(tally: Tally) -> dict[str, int]:
    return {name: getattr(tally, name) for name in COUNTED}
