"""Item leases: which chunk run holds an item, until when, and what the reconciler re-sends.

A run takes its chunk's open items with an expiry and renews it while it lives. An item whose
lease ran out (its worker was killed, its database connection lost) is taken again by the next
run of its chunk. Functions here never commit: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import itemgetter
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    ColumnElement,
    Table,
    and_,
    case,
    exists,
    func,
    literal,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from kiln.app.db import counters, dialect
from kiln.app.db.items import end_items
from kiln.app.db.models import (
    OPEN_ITEM_STATUSES,
    OPEN_JOB_STATUSES,
    Ingest,
    Item,
    ItemStatus,
    Job,
    utcnow,
)


class LeasedItem(NamedTuple):
    """What a chunk run needs of an item it leased (a plain row: no ORM object to track; a
    tuple, built in C, as a chunk takes hundreds at once)."""

    id: int
    job_id: str
    key: str
    source: str | None
    text: str | None
    chunk: int
    attempts: int
    frame_index: int | None = None  # a video's sampled frame (its source is the video's)
    frame_time_s: float | None = None


_ITEMS = cast(Table, Item.__table__)


def _of_job(session: Session, job_id: str) -> ColumnElement[bool]:
    """The items found by id are the job's: checked per item, not used to find them
    (`dialect.checked`)."""
    return dialect.checked(session, Item.job_id == job_id)


def _takeable(owner: str, now: datetime) -> ColumnElement[bool]:
    """Pending, or running under a lease that ran out — or under this very run's own lease
    (a Celery retry of the same message keeps its task id, the owner)."""
    return or_(
        Item.status == ItemStatus.PENDING,
        and_(
            Item.status == ItemStatus.RUNNING,
            or_(
                Item.lease_owner == owner,
                Item.lease_expires_at.is_(None),
                Item.lease_expires_at < now,
            ),
        ),
    )


@dataclass(frozen=True)
class JobFacts:
    """What a chunk run needs of its job, read with the lease."""

    id: str
    tenant: str
    model: str
    status: str
    chunk_count: int
    output: str | None
    bulk: bool  # items come from an ingest (the chunk count grows while it lists)
    pipeline_id: int | None
    options: dict[str, Any] | None = None  # the job's (its fallback model, if any)


_FACTS = (  # JobFacts's fields, in order
    Job.id,
    Job.tenant,
    Job.model,
    Job.status,
    Job.chunk_count,
    Job.output,
    Job.source.is_not(None),
    Job.pipeline_id,
    Job.options,
)


def take(
    session: Session,
    job_id: str,
    item_ids: Sequence[int],
    owner: str,
    lease_s: float,
    max_attempts: int | None = None,
) -> list[LeasedItem]:
    """Lease the chunk's takeable items to `owner` and return them, in id order; others are
    left alone (and, with `max_attempts`, items already run that often: `give_up` fails them).

    One statement, and no lock on the job row: the items are locked in id order, as a cancel
    locks them, so the two queue instead of deadlocking; a cancel that wins leaves nothing
    pending to take.
    """
    now = utcnow()
    takeable = (
        select(Item.id)
        .where(_of_job(session, job_id), dialect.among(session, Item.id, item_ids))
        .where(_takeable(owner, now))
        .order_by(Item.id)
        .with_for_update()
    )
    if max_attempts is not None:
        takeable = takeable.where(Item.attempts < max_attempts)
    # On the items table, not the mapped class: a Core UPDATE … RETURNING hands back plain
    # rows, without the ORM's bulk-update path per row (~0.5 µs a row of a chunk's take).
    items = _ITEMS.c
    rows = session.execute(
        update(_ITEMS)
        .where(items.id.in_(takeable))
        .values(
            status=ItemStatus.RUNNING,
            attempts=items.attempts + 1,
            started_at=now,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_s),
        )
        .returning(
            items.id,
            items.job_id,
            items.key,
            items.source,
            items.text,
            items.chunk,
            items.attempts,
            items.frame_index,
            items.frame_time_s,
        )
    )
    return sorted(map(LeasedItem._make, rows), key=itemgetter(0))  # by id


def gave_up(max_attempts: int) -> str:
    """The sentence of an item given up on (its last recorded error follows it, if any)."""
    return (
        f"Kiln gave up on this input after {max_attempts} attempts; each run stopped before "
        "finishing it (a worker crash, a lost lease or repeated transient errors)."
    )


def give_up(
    session: Session,
    job_id: str,
    chunk: int,
    item_ids: Sequence[int],
    owner: str,
    max_attempts: int,
) -> int:
    """Fail, counted, the chunk's takeable items already taken `max_attempts` times, with the
    reason and the last error a run recorded on them (`release`); how many. Checked on the
    locked rows, before `take` counts one more attempt, so an item's attempts never pass the
    limit, however many copies of its chunk run: a failure recorded here needs no shard
    write to stick (the chunk's shard picks it up as an earlier result)."""
    now = utcnow()
    spent = (
        select(Item.id)
        .where(_of_job(session, job_id), dialect.among(session, Item.id, item_ids))
        .where(_takeable(owner, now), Item.attempts >= max_attempts)
        .order_by(Item.id)
        .with_for_update()
    )
    sentence = gave_up(max_attempts)
    error = case(
        (Item.error.is_(None), literal(sentence)),
        else_=literal(f"{sentence} The last error recorded: ") + Item.error,
    )
    failed = end_items(session, spent, ItemStatus.FAILED, error, now)
    counters.add(session, job_id, counters.slot_of(chunk), counters.Tally(failed=failed))
    return failed


@dataclass(frozen=True)
class TakenChunk:
    """What a chunk run took: its items (none when another live run holds them) and its job."""

    items: list[LeasedItem]
    job: JobFacts
    held_elsewhere: bool  # nothing taken because another live run holds the chunk


def take_chunk(
    session: Session,
    job_id: str,
    chunk: int,
    item_ids: Sequence[int],
    owner: str,
    lease_s: float,
    max_attempts: int,
) -> TakenChunk | None:
    """Take a chunk's open items and read its job (no lock on its row); None when the job no
    longer exists. Items already run `max_attempts` times fail instead (`give_up`): never
    taken, so an item's attempts never pass the limit. `give_up` is a statement of its own,
    run on the items not taken, only when there are some (a fresh chunk takes them all: one
    statement less per chunk)."""
    items = take(session, job_id, item_ids, owner, lease_s, max_attempts)
    # Not among what it just took: an item leased now to its last attempt is takeable (its
    # own lease) with `max_attempts` spent.
    rest = sorted(set(item_ids).difference(item.id for item in items))
    if rest:
        give_up(session, job_id, chunk, rest, owner, max_attempts)
    job = job_facts(session, job_id)
    if job is None:
        return None
    return TakenChunk(items, job, not items and held_elsewhere(session, item_ids, owner))


def job_facts(session: Session, job_id: str) -> JobFacts | None:
    """The job's facts a chunk run needs (a plain read: no lock)."""
    row = session.execute(select(*_FACTS).where(Job.id == job_id)).one_or_none()
    return JobFacts(*row) if row is not None else None


def _running(session: Session, item_ids: Sequence[int], owned: ColumnElement[bool]) -> int:
    """How many of these items are running under a lease that matches `owned`."""
    query = select(func.count()).where(
        Item.id.in_(item_ids), Item.status == ItemStatus.RUNNING, owned
    )
    return int(session.scalar(query) or 0)


def held_elsewhere(session: Session, item_ids: Sequence[int], owner: str) -> bool:
    """Some of these items run under another live lease (a duplicate message arrived)."""
    return _running(session, item_ids, Item.lease_owner != owner) > 0


def _held_by(job_id: str, owner: str) -> ColumnElement[bool]:
    return and_(Item.job_id == job_id, Item.lease_owner == owner, Item.status == ItemStatus.RUNNING)


def renew_many(
    session: Session, owners: Sequence[str], lease_s: float, keep_s: float | None = None
) -> dict[str, int]:
    """Push out the leases of many runs in one statement (a worker's one keeper); returns how
    many items each run still holds (a run missing from the answer holds none).

    `keep_s`: a lease with more than this left is not rewritten. A lease can only be lost once
    it has run out (`take` and `reset_expired` take expired items only), so a keeper that
    renews every few seconds need not rewrite every held row each time: rewriting a chunk's 512
    rows (and their index entries) every tick cost the keeper ~25 µs a row processed on SQLite.
    The count comes from a read grouped by run, one row per run, not one per item."""
    if not owners:
        return {}
    now = utcnow()
    renew = update(Item).where(
        Item.status == ItemStatus.RUNNING, dialect.among_text(session, Item.lease_owner, owners)
    )
    if keep_s is not None:
        due = now + timedelta(seconds=keep_s)
        renew = renew.where(or_(Item.lease_expires_at.is_(None), Item.lease_expires_at < due))
    session.execute(
        renew.values(lease_expires_at=now + timedelta(seconds=lease_s)),
        execution_options={"synchronize_session": False},
    )
    rows = session.execute(
        select(Item.lease_owner, func.count())
        .where(
            Item.status == ItemStatus.RUNNING,
            dialect.among_text(session, Item.lease_owner, owners),
        )
        .group_by(Item.lease_owner)
    )
    return {str(owner): int(count) for owner, count in rows}


def job_statuses(session: Session, job_ids: Collection[str]) -> dict[str, str]:
    """The status of each of these jobs (a missing job is left out)."""
    if not job_ids:
        return {}
    rows = session.execute(select(Job.id, Job.status).where(Job.id.in_(sorted(job_ids))))
    return {job_id: str(status) for job_id, status in rows}


def holds(session: Session, job_id: str, owner: str) -> int:
    """How many of the job's items `owner` (one chunk run) still holds (0: its lease was
    taken over)."""
    return int(session.scalar(select(func.count()).where(_held_by(job_id, owner))) or 0)


def holds_any(session: Session, job_id: str, owner: str, item_ids: Sequence[int]) -> bool:
    """Whether `owner` still holds any of `item_ids` (its run's items): what a run asks before
    it writes. Read by primary key, so the answer is the first id's row when the lease holds:
    the job's running items, every chunk's in flight, are not scanned for one of the run's."""
    held = and_(_held_by(job_id, owner), dialect.among(session, Item.id, item_ids))
    return bool(session.scalar(select(exists().where(held))))


def release(
    session: Session, job_id: str, owner: str, reason: str | None = None, charged: bool = True
) -> int:
    """Hand the items back (a run that stops without results): pending, no owner. `reason`:
    why the run stopped, kept as the items' error until a run finishes them (an item given up
    on says it). Not `charged`: the attempt is not counted against the items (Kiln's own setup
    stopped the run, not anything about them)."""
    values: dict[str, Any] = {
        "status": ItemStatus.PENDING,
        "lease_owner": None,
        "lease_expires_at": None,
        "queued_at": utcnow(),  # the task's retry message is on its way
    }
    if reason is not None:
        values["error"] = reason
    if not charged:
        values["attempts"] = case((Item.attempts > 0, Item.attempts - 1), else_=0)
    result = session.execute(update(Item).where(_held_by(job_id, owner)).values(values))
    return int(result.rowcount)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StrandedChunk:
    """A chunk of an open job with items waiting and, as far as Postgres knows, no run."""

    job_id: str
    chunk: int
    queue: str
    item_ids: list[int]


def reset_expired(session: Session, limit: int = 10_000) -> set[tuple[str, int]]:
    """Running items of open jobs whose lease ran out go back to pending, due at once;
    returns their (job, chunk)s."""
    now = utcnow()
    expired = (
        select(Item.id)
        .join(Job, Job.id == Item.job_id)
        .where(
            Item.status == ItemStatus.RUNNING,
            or_(Item.lease_expires_at.is_(None), Item.lease_expires_at < now),
            Job.status.in_(OPEN_JOB_STATUSES),
        )
        .limit(limit)
    )
    result = session.execute(
        update(Item)
        .where(Item.id.in_(expired))
        .values(
            status=ItemStatus.PENDING,
            lease_owner=None,
            lease_expires_at=None,
            queued_at=now - timedelta(days=1),  # stranded: due for a new message now
        )
        .returning(Item.job_id, Item.chunk),
        execution_options={"synchronize_session": False},
    )
    return {(job_id, chunk) for job_id, chunk in result}


def stranded_chunks(
    session: Session, older_than_s: float, limit: int = 1000
) -> list[StrandedChunk]:
    """Chunks of open jobs with pending items last sent more than `older_than_s` ago; each
    with all its pending items, so a re-sent message covers the whole chunk."""
    stale = and_(
        Item.status == ItemStatus.PENDING,
        or_(Item.queued_at.is_(None), Item.queued_at < utcnow() - timedelta(seconds=older_than_s)),
    )
    found = session.execute(
        select(Item.job_id, Item.chunk, Job.queue)
        .join(Job, Job.id == Item.job_id)
        .outerjoin(Ingest, Ingest.job_id == Item.job_id)
        # a bulk chunk the fair share has not sent yet is waiting, not lost
        .where(stale, Job.status.in_(OPEN_JOB_STATUSES))
        .where(or_(Ingest.job_id.is_(None), Item.chunk < Ingest.chunks_sent))
        .distinct()
        .limit(limit)
    ).all()
    chunks: list[StrandedChunk] = []
    for job_id, chunk, queue in found:
        ids = session.scalars(
            select(Item.id)
            .where(Item.job_id == job_id, Item.chunk == chunk, Item.status == ItemStatus.PENDING)
            .order_by(Item.id)
        )
        chunks.append(StrandedChunk(job_id, chunk, queue, list(ids)))
    return chunks


def mark_sent(session: Session, item_ids: Sequence[int]) -> None:
    session.execute(
        update(Item)
        .where(Item.id.in_(item_ids), Item.status == ItemStatus.PENDING)
        .values(queued_at=utcnow())
    )


def ended_open_jobs(session: Session, limit: int = 100) -> list[str]:
    """Open jobs with no open item and no listing under way: their last chunk stopped before
    it closed them (a crash between two commits). Newest-first is not needed: all are due."""
    open_items = exists().where(Item.job_id == Job.id, Item.status.in_(OPEN_ITEM_STATUSES))
    listing = exists().where(Ingest.job_id == Job.id, Ingest.done.is_(False))
    return list(
        session.scalars(
            select(Job.id)
            .where(Job.status.in_(OPEN_JOB_STATUSES), ~open_items, ~listing)
            .limit(limit)
        )
    )
