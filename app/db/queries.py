"""Small query functions over jobs and items. They never commit: the caller owns the transaction."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    DateTime,
    and_,
    bindparam,
    case,
    exists,
    func,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.orm import Session

from kiln.app.db import chunk_runs, counters, dialect, webhooks
from kiln.app.db.items import end_items
from kiln.app.db.models import (
    OPEN_ITEM_STATUSES,
    OPEN_JOB_STATUSES,
    EngineReport,
    Ingest,
    Item,
    ItemStatus,
    Job,
    JobCounter,
    JobStatus,
    Pipeline,
    aware,
    utcnow,
)
from kiln.app.db.notify import closed_notice
from kiln.app.jobs.throughput import Span
from kiln.app.sources import VIDEO_SUFFIXES


@dataclass(frozen=True)
class Counts:
    total: int = 0
    succeeded: int = 0
    failed: int = 0
    pending: int = 0  # pending or running: not finished yet
    cancelled: int = 0
    skipped: int = 0  # bulk, incremental: unchanged since the pipeline's last run
    deleted: int = 0  # bulk, incremental: gone since the pipeline's last run
    known_failed: int = 0  # bulk, incremental: unchanged, failed before with this model: kept
    excluded: int = 0  # bulk: objects listed that the source's filters left out
    fell_back: int = 0  # items the job's fallback model took
    fell_back_succeeded: int = 0  # of those, the items it answered
    listing: bool = False  # bulk: the source is still being listed, more items may come

    @property
    def done(self) -> int:
        return self.succeeded + self.failed + self.cancelled


def job_counts(session: Session, job_id: str, bulk: bool = True) -> Counts:
    """The job's counters (a few rows, whatever the job's size; `counters` says why they
    cannot drift) and, for a bulk job (`bulk`), its listing's progress."""
    ingest = session.get(Ingest, job_id) if bulk else None
    return _counts(ingest, counters.read(session, job_id))


def counts_and_answered(
    session: Session, job_id: str, bulk: bool, fresh_since: datetime
) -> tuple[Counts, int]:
    """The job's counts and its live runs' answered rows (`chunk_runs.answered_sum`), read in
    one statement: a chunk's write moves its rows from the one to the other in one
    transaction, so two reads could see them in neither (the bar stepped back) or in both."""
    answered = chunk_runs.answered_sum(job_id, fresh_since)
    tally, answered_rows = counters.read_with(session, job_id, answered)
    return _counts(session.get(Ingest, job_id) if bulk else None, tally), answered_rows


def _counts(ingest: Ingest | None, tally: counters.Tally) -> Counts:
    return Counts(
        skipped=ingest.skipped if ingest else 0,
        deleted=ingest.deleted if ingest else 0,
        known_failed=ingest.known_failed if ingest else 0,
        excluded=ingest.excluded if ingest else 0,
        listing=bool(ingest and not ingest.done),
        total=tally.total,
        succeeded=tally.succeeded,
        failed=tally.failed,
        pending=tally.open,
        cancelled=tally.cancelled,
        fell_back=tally.fell_back,
        fell_back_succeeded=tally.fell_back_succeeded,
    )


@dataclass(frozen=True)
class Activity:
    """What an open job's items are doing now (a few indexed reads, whatever the job's size)."""

    running: int = 0  # leased by a chunk run: in prep or in a batch
    recent: int = 0  # finished (succeeded or failed) since the window's start
    stalled_since: datetime | None = None  # the last renewal of leases nobody renews any more
    in_flight: chunk_runs.InFlight = field(default_factory=chunk_runs.InFlight)  # not written


def job_activity(
    session: Session, job_id: str, window_start: datetime, lease_s: float, stale_s: float
) -> Activity:
    """Running items, items finished since `window_start`, and whether running items sit
    under leases no run has renewed for `stale_s` (their worker stopped): since when."""
    now = utcnow()
    # A lease renewed at t expires at t + lease_s: renewed before now - stale_s means stale.
    stale = Item.lease_expires_at < now + timedelta(seconds=lease_s - stale_s)
    running, oldest = session.execute(
        select(func.count(), func.min(case((stale, Item.lease_expires_at)))).where(
            Item.job_id == job_id, Item.status == ItemStatus.RUNNING
        )
    ).one()
    # A count, not `finished_spans`: this is read on every poll of an open job, and grouping a
    # busy job's last minute by run costs twice the count (bench bigjob: GET p50 ×2.4).
    recent = session.scalar(
        select(func.count()).where(
            Item.job_id == job_id,
            Item.finished_at >= window_start,
            Item.status.in_((ItemStatus.SUCCEEDED, ItemStatus.FAILED)),
        )
    )
    expires = aware(oldest)
    stalled = expires - timedelta(seconds=lease_s) if expires is not None else None
    flying = chunk_runs.in_flight(session, job_id, now - timedelta(seconds=stale_s))
    return Activity(int(running), int(recent or 0), stalled, flying)


def finished_spans(session: Session, job_id: str, since: datetime | None = None) -> list[Span]:
    """The job's items that succeeded or failed (since `since`), as worked from their lease to
    their write: one `Span` per run that wrote them (its items share both times), so a range
    read of `ix_items_job_finished` grouped to a row per chunk run, not per item."""
    query = select(Item.started_at, Item.finished_at, func.count()).where(
        Item.job_id == job_id,
        Item.finished_at.is_not(None),
        Item.status.in_((ItemStatus.SUCCEEDED, ItemStatus.FAILED)),
    )
    if since is not None:
        query = query.where(Item.finished_at >= since)
    rows = session.execute(query.group_by(Item.started_at, Item.finished_at)).all()
    spans = []
    for started, finished, count in rows:
        end = aware(finished)
        assert end is not None  # selected so
        begun = aware(started)  # None: it ended never leased (a failed job ended what waited)
        start = begun if begun is not None and begun <= end else end
        spans.append(Span(start.timestamp(), end.timestamp(), int(count)))
    return spans


def tenant_job(session: Session, tenant: str, job_id: str) -> Job | None:
    return session.scalar(select(Job).where(Job.id == job_id, Job.tenant == tenant))


def lock_job(session: Session, job_id: str, tenant: str | None = None) -> Job | None:
    """Lock the job row for this transaction.

    Lock order is job row first, then its items: every writer that touches both (lease,
    cancel) takes the job lock first, so they queue instead of deadlocking. The row is read
    afresh even when the session holds the job already (an ingest step's, loaded pages ago),
    so a cancel committed meanwhile is seen.
    """
    query = select(Job).where(Job.id == job_id)
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    return session.scalar(query.with_for_update().execution_options(populate_existing=True))


def mark_job_running(session: Session, job_id: str) -> None:
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.QUEUED)
        .values(status=JobStatus.RUNNING, started_at=utcnow())
    )


def upsert_results(
    session: Session,
    job_id: str,
    chunk: int,
    results: Sequence[Sequence[Any]],
    owner: str | None = None,
) -> None:
    """One statement for the whole chunk, keyed by (job_id, key): a replay changes nothing.

    `results`: one row per item, its values in `RESULT_COLUMNS` order. The rows travel as one
    JSON document (one C-encoded string) joined to the items in one UPDATE whose text never
    changes, so the driver prepares it once. Only a running item takes a result, so a
    cancelled item stays cancelled; with `owner`, only one this run still leases (a run whose
    lease was taken over writes nothing). The rows that did change are added to the job's
    counters, in the same transaction.
    """
    if not results:
        return
    postgres = dialect.on_postgres(session)
    statement = _UPDATE_POSTGRES if postgres else _UPDATE_SQLITE
    dialect.open_transaction(session)  # the SQLite statement opens with WITH
    params = {"job_id": job_id, "owner": owner, "finished_at": utcnow()}
    changed = session.execute(statement, params | _documents(results, postgres))
    # SQLite's rows fetched at once: iterated one by one, the result cost ~1 µs a row.
    tally = _ended_tally(changed) if postgres else _ended_rows(changed.all())
    counters.add(session, job_id, counters.slot_of(chunk), tally)


def _documents(results: Sequence[Sequence[Any]], postgres: bool) -> dict[str, Any]:
    """The statement's JSON parameters. SQLite: the outputs (the bulk of a row's text) in an
    array of their own, beside the rows' other values: SQLite 3.40 parses a row's text again
    for each value it reads out of it, so a row whose outputs ride along was parsed nine
    times (half of the statement's time on a 512-row chunk). For the same reason a column
    null in every row (error, fallback_reason, stages_ms: most chunks) is not read out of any
    row: a flag says which are (a 512-row chunk's statement ~9% faster)."""
    if postgres:
        return {"rows": _encode(results)}
    rest = [(*row[:_OUTPUTS], *row[_OUTPUTS + 1 :]) for row in results]
    return {
        "rows": _encode(rest),
        "outputs": _encode([row[_OUTPUTS] for row in results]),
        **{name: any(row[at] is not None for row in results) for name, at in _SPARSE.items()},
    }


def _ended_rows(changed: Iterable[Sequence[Any]]) -> counters.Tally:
    """The counters' change from the changed rows themselves (SQLite: one row per item)."""
    # The reason itself, not `IS NOT NULL`: SQLite 3.40 answers that wrongly in the RETURNING
    # of an UPDATE … FROM (true for a null).
    statuses = [(str(status), reason is not None) for status, reason in changed]
    fell_back = [status for status, fell in statuses if fell]
    return counters.ended([status for status, _ in statuses], fell_back)


def _ended_tally(changed: Iterable[Sequence[Any]]) -> counters.Tally:
    """The counters' change from the changed rows counted by status in the statement
    (Postgres: a row per status, not one per item)."""
    counted = {str(status): (int(rows), int(fell)) for status, rows, fell in changed}
    none = (0, 0)
    return counters.Tally(
        succeeded=counted.get(ItemStatus.SUCCEEDED, none)[0],
        failed=counted.get(ItemStatus.FAILED, none)[0],
        cancelled=counted.get(ItemStatus.CANCELLED, none)[0],
        fell_back=sum(fell for _rows, fell in counted.values()),
        fell_back_succeeded=counted.get(ItemStatus.SUCCEEDED, none)[1],
    )


RESULT_COLUMNS = (
    "key", "status", "error", "outputs", "duration_ms", "sha256", "answered_by", "fallback_reason",
    "stages_ms",
)  # fmt: skip

# `json` has no equality, so a JSON null (a failed item's outputs) is told by its type. On
# SQLite the rows are materialized first: joined straight to json_each, the planner scans the
# job's items and json_each inside (a chunk of 512 in a job of 100,000 took 21 s, not 1 ms).
_UPDATE_POSTGRES = text(
    """
    WITH changed AS (
    UPDATE items SET status = v.status, error = v.error,
           outputs = CASE WHEN json_typeof(v.outputs) = 'null' THEN NULL ELSE v.outputs END,
           duration_ms = v.duration_ms, sha256 = v.sha256, answered_by = v.answered_by,
           fallback_reason = v.fallback_reason,
           stages_ms = CASE WHEN json_typeof(v.stages_ms) = 'null' THEN NULL ELSE v.stages_ms END,
           finished_at = :finished_at
    FROM (SELECT e->>0 AS key, e->>1 AS status, e->>2 AS error, e->3 AS outputs,
                 CAST(e->>4 AS float8) AS duration_ms, e->>5 AS sha256, e->>6 AS answered_by,
                 e->>7 AS fallback_reason, e->8 AS stages_ms
          FROM json_array_elements(CAST(:rows AS json)) AS e) AS v
    WHERE items.job_id = :job_id AND items.key = v.key AND items.status = 'running'
      AND (CAST(:owner AS text) IS NULL OR items.lease_owner = :owner)
    RETURNING items.status, items.fallback_reason)
    SELECT status, count(*), count(fallback_reason) FROM changed GROUP BY status
    """
).bindparams(bindparam("finished_at", type_=DateTime(timezone=True)))

_OUTPUTS = RESULT_COLUMNS.index("outputs")
# SQLite: the columns whose flag (all null in this chunk: false) spares reading them per row.
_SPARSE = {
    "has_" + name: RESULT_COLUMNS.index(name) for name in ("error", "fallback_reason", "stages_ms")
}
# The documents are trees built here (no cycles): not checking for them saves ~20% of the
# encoding (a 512-row chunk's outputs: ~0.2 ms).
_encode = json.JSONEncoder(check_circular=False).encode
# SQLite: the rows without their outputs (`:rows`, the other values in `RESULT_COLUMNS` order)
# and the outputs by position (`:outputs`), joined on the position (json_each's `key`).
_UPDATE_SQLITE = text(
    """
    WITH o AS MATERIALIZED (
        SELECT key AS i, CASE type WHEN 'null' THEN NULL ELSE value END AS outputs
        FROM json_each(:outputs)),
    v AS MATERIALIZED (
        SELECT r.value ->> 0 AS key, r.value ->> 1 AS status,
               CASE WHEN :has_error THEN r.value ->> 2 END AS error,
               o.outputs, r.value ->> 3 AS duration_ms, r.value ->> 4 AS sha256,
               r.value ->> 5 AS answered_by,
               CASE WHEN :has_fallback_reason THEN r.value ->> 6 END AS fallback_reason,
               CASE WHEN :has_stages_ms THEN
                   CASE json_type(r.value, '$[7]') WHEN 'null' THEN NULL ELSE r.value -> 7 END
               END AS stages_ms
        FROM json_each(:rows) AS r CROSS JOIN o ON o.i = r.key)
    UPDATE items SET status = v.status, error = v.error, outputs = v.outputs,
           duration_ms = v.duration_ms, sha256 = v.sha256, answered_by = v.answered_by,
           fallback_reason = v.fallback_reason, stages_ms = v.stages_ms,
           finished_at = :finished_at
    FROM v
    WHERE items.job_id = :job_id AND items.key = v.key AND items.status = 'running'
      AND (:owner IS NULL OR items.lease_owner = :owner)
    RETURNING items.status, items.fallback_reason
    """
).bindparams(bindparam("finished_at", type_=DateTime(timezone=True)))


def finished_chunk_items(session: Session, job_id: str, chunk: int) -> list[Item]:
    return list(
        session.scalars(
            select(Item)
            .where(
                Item.job_id == job_id,
                Item.chunk == chunk,
                Item.status.not_in(OPEN_ITEM_STATUSES),
            )
            .order_by(Item.id)
        )
    )


def nothing_open(session: Session, job_id: str) -> bool:
    """No item of the job is open and its source (a bulk job's) is listed to the end: what
    `finish_job_if_done` asks before it closes the job."""
    open_items = exists().where(Item.job_id == job_id, Item.status.in_(OPEN_ITEM_STATUSES))
    listing = exists().where(Ingest.job_id == job_id, Ingest.done.is_(False))
    return not session.scalar(select(or_(open_items, listing)))


@dataclass(frozen=True)
class Closing:
    """What a job's close reads, once none of its items is open: the job as the database has
    it now, its counts (final: only an open item or a listing can change them), its chunks
    (each owes a shard) and the items of those that have none yet, by chunk, in id order."""

    job: Job
    counts: Counts
    chunks: list[int]
    unwritten: dict[int, list[Item]]


def closing(session: Session, job_id: str, written: Collection[int]) -> Closing | None:
    """The close's one read (`written`: the chunks that have a shard; the others' items come
    with it); None while an item of the job is open or its source is still listed (or when
    there is no such job)."""
    if not nothing_open(session, job_id):
        return None
    tally = select(*counters.sums()).where(JobCounter.job_id == job_id).subquery()
    row = session.execute(
        select(Job, Ingest, *tally.c)  # the job as now, its listing and its counts: one read
        .outerjoin(Ingest, Ingest.job_id == Job.id)
        .join(tally, true())
        .where(Job.id == job_id)
        .execution_options(populate_existing=True)
    ).one_or_none()
    if row is None:
        return None
    job, ingest, *counted = row
    counts = _counts(ingest, counters.Tally(*(int(n) for n in counted)))
    chunks = job_chunks(session, job_id)
    missing = [chunk for chunk in chunks if chunk not in written]
    unwritten = chunk_items(session, job_id, missing) if missing else {}
    return Closing(job, counts, chunks, unwritten)


def job_chunks(session: Session, job_id: str) -> list[int]:
    return list(
        session.scalars(
            select(Item.chunk).where(Item.job_id == job_id).distinct().order_by(Item.chunk)
        )
    )


def chunk_items(session: Session, job_id: str, chunks: Collection[int]) -> dict[int, list[Item]]:
    """The items of these chunks of the job, by chunk, each in id order (one statement)."""
    found: dict[int, list[Item]] = {chunk: [] for chunk in chunks}
    query = select(Item).where(Item.job_id == job_id, Item.chunk.in_(list(chunks)))
    for item in session.scalars(query.order_by(Item.chunk, Item.id)):
        found[item.chunk].append(item)
    return found


@dataclass(frozen=True)
class Finished:
    """A job as its close left it."""

    status: str
    started_at: datetime
    finished_at: datetime


def finish_job_if_done(session: Session, job_id: str) -> Finished | None:
    """Close the job once no item is open; what the close set if this call closed it.

    One statement: concurrent callers serialise on the job row, and only one sees a row back;
    on Postgres the same statement tells the API (`notify`: delivered only if it commits).
    """
    open_items = exists().where(Item.job_id == job_id, Item.status.in_(OPEN_ITEM_STATUSES))
    listing = exists().where(Ingest.job_id == job_id, Ingest.done.is_(False))  # more may come
    now = utcnow()
    final = case(
        (Job.status == JobStatus.CANCELLING, JobStatus.CANCELLED.value),
        else_=JobStatus.COMPLETED.value,
    )
    told = [closed_notice(Job.id)] if dialect.on_postgres(session) else []
    row = session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status.in_(OPEN_JOB_STATUSES), ~open_items, ~listing)
        .values(status=final, finished_at=now, started_at=func.coalesce(Job.started_at, now))
        .returning(Job.status, Job.started_at, Job.finished_at, *told),
        execution_options={"synchronize_session": False},
    ).one_or_none()
    if row is None:
        return None
    webhooks.record_end(session, job_id, str(row[0]))  # its webhook's event, same transaction
    return Finished(str(row[0]), row[1] or now, row[2] or now)  # the update set both


def cancel_items(session: Session, job_id: str) -> int:
    """Cancel the job's pending items and count them."""
    return end_pending(session, job_id, ItemStatus.CANCELLED, "The job was cancelled.")


def end_pending(session: Session, job_id: str, status: str, error: str) -> int:
    """End the job's pending items as `status` with `error` (locked in id order, as a lease
    takes them, so the two cannot deadlock), counted; how many."""
    pending = (
        select(Item.id)
        .where(Item.job_id == job_id, Item.status == ItemStatus.PENDING)
        .order_by(Item.id)
        .with_for_update()
    )
    ended = end_items(session, pending, status, error, utcnow())
    cancelled = status == ItemStatus.CANCELLED
    tally = counters.Tally(cancelled=ended) if cancelled else counters.Tally(failed=ended)
    counters.add(session, job_id, 0, tally)
    return ended


def list_items(
    session: Session, job_id: str, *, status: str | None, after: int, limit: int
) -> list[Item]:
    query = select(Item).where(Item.job_id == job_id, Item.id > after)
    if status:
        query = query.where(Item.status == status)
    return list(session.scalars(query.order_by(Item.id).limit(limit)))


@dataclass(frozen=True)
class JobFilter:
    """What a listing of jobs keeps: this status, runs of this pipeline, runs this schedule
    started (a name that matches nothing keeps nothing)."""

    status: str | None = None
    pipeline: str | None = None
    schedule: str | None = None


def list_jobs(
    session: Session, tenant: str, *, after: Job | None, limit: int, only: JobFilter = JobFilter()
) -> list[Job]:
    """The tenant's jobs that `only` keeps, newest first; `after` is the last job of the
    previous page."""
    query = select(Job).where(Job.tenant == tenant)
    if only.status is not None:
        query = query.where(Job.status == only.status)
    if only.schedule is not None:
        query = query.where(Job.schedule == only.schedule)
    if only.pipeline is not None:
        query = query.join(Pipeline, Pipeline.id == Job.pipeline_id).where(
            Pipeline.tenant == tenant, Pipeline.name == only.pipeline
        )
    if after is not None:
        query = query.where(
            or_(
                Job.created_at < after.created_at,
                and_(Job.created_at == after.created_at, Job.id < after.id),
            )
        )
    return list(session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)))


def report_engine(
    session: Session, node: str, model: str, backend: str, reason: str, device: str
) -> None:
    """Upsert which backend `node` runs `model` on."""
    values = {"node": node, "model": model, "backend": backend, "reason": reason,
              "device": device, "updated_at": utcnow()}  # fmt: skip
    statement = dialect.insert(session, EngineReport).values(values)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[EngineReport.node, EngineReport.model],
            set_={k: statement.excluded[k] for k in ("backend", "reason", "device", "updated_at")},
        )
    )


def engine_reports(session: Session, models: Sequence[str]) -> list[EngineReport]:
    """What workers said about these models, most recent first."""
    return list(
        session.scalars(
            select(EngineReport)
            .where(EngineReport.model.in_(models))
            .order_by(EngineReport.updated_at.desc())
        )
    )


def item_outputs(session: Session, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(key, outputs) of the job's succeeded items, in submission order."""
    rows = session.execute(
        select(Item.key, Item.outputs)
        .where(Item.job_id == job_id, Item.status == ItemStatus.SUCCEEDED)
        .order_by(Item.id)
    )
    return [(key, outputs or {}) for key, outputs in rows]


def identical_inputs(session: Session, job_id: str) -> list[tuple[str, str]]:
    """(sha256, key) of the job's items whose bytes another item of the job shares, by digest
    then submission order: one query at close, returning only the duplicates."""
    shared = (
        select(Item.sha256)
        .where(Item.job_id == job_id, Item.sha256.is_not(None))
        .group_by(Item.sha256)
        .having(func.count() > 1)
    )
    rows = session.execute(
        select(Item.sha256, Item.key)
        .where(Item.job_id == job_id, Item.sha256.in_(shared))
        .order_by(Item.sha256, Item.id)
    )
    return [(digest, key) for digest, key in rows if digest is not None]


def item_by_key(session: Session, job_id: str, key: str) -> Item | None:
    """One item of a job by its key (unique per job)."""
    return session.scalar(select(Item).where(Item.job_id == job_id, Item.key == key))


def is_open(job: Job) -> bool:
    return job.status in OPEN_JOB_STATUSES


# A job with more open items than this does not count its unplanned videos (a scan of them).
UNPLANNED_SCAN_MAX = 10_000


def unplanned_videos(session: Session, job_id: str, open_items: int) -> int | None:
    """Open items of the job named as videos (`sources.VIDEO_SUFFIXES`) that no worker has
    expanded into their frames yet: the total grows by their frames once one does. None
    (not counted) past UNPLANNED_SCAN_MAX open items; 0 with none open."""
    if open_items <= 0:
        return 0
    if open_items > UNPLANNED_SCAN_MAX:
        return None
    key = func.lower(Item.key)
    named = or_(*(key.like(f"%{suffix}") for suffix in sorted(VIDEO_SUFFIXES)))
    count = session.scalar(
        select(func.count()).where(
            Item.job_id == job_id,
            Item.status.in_(OPEN_ITEM_STATUSES),
            Item.frame_time_s.is_(None),  # a frame is planned already
            named,
        )
    )
    return int(count or 0)
