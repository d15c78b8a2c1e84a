"""Writing a chunk's results on Postgres (one UPDATE over a JSON document): the same rules as the
SQLite upsert, and counters that move only with the rows that changed."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from kiln.app.db import counters, leases, queries
from kiln.app.db.models import Item, ItemStatus, Job, JobStatus


def job_of(session: Session, keys: list[str]) -> tuple[str, list[int]]:
    job = Job(id=str(uuid.uuid4()), tenant="acme", model="detector", status=JobStatus.RUNNING)
    session.add(job)
    session.flush()
    session.add_all(Item(job_id=job.id, key=k, source=f"store:x/{k}") for k in keys)
    session.flush()
    counters.add(session, job.id, 0, counters.Tally(total=len(keys)))
    ids = list(session.scalars(select(Item.id).where(Item.job_id == job.id).order_by(Item.id)))
    return job.id, ids


def row(key: str, status: str = ItemStatus.SUCCEEDED, **extra: Any) -> tuple[Any, ...]:
    """One item's result as `upsert_results` takes it (values in `RESULT_COLUMNS` order)."""
    base = {"key": key, "status": status, "error": None, "duration_ms": 2.5}
    values = {"outputs": {"labels": [{"label": "cat", "score": 0.5}]}, **base, **extra}
    return tuple(values.get(name) for name in queries.RESULT_COLUMNS)


def by_key(session: Session, job_id: str) -> dict[str, Item]:
    session.expire_all()
    return {i.key: i for i in session.scalars(select(Item).where(Item.job_id == job_id))}


def test_results_land_once_and_only_for_the_lease_holder(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id, ids = job_of(session, ["a", "b", "c", "d"])
        leases.take(session, job_id, ids[:3], "run-1", 60)  # "d" stays pending
        failed = row("b", ItemStatus.FAILED, error="Bad.", outputs=None)
        results = [row("a"), failed, row("d")]  # "d" is not running: ignored
        queries.upsert_results(session, job_id, 0, results, owner="run-2")  # not the holder
        session.commit()
        assert {i.status for i in by_key(session, job_id).values()} <= {"running", "pending"}

        queries.upsert_results(session, job_id, 0, results, owner="run-1")
        queries.upsert_results(session, job_id, 0, results, owner="run-1")  # a replay
        session.commit()

        items = by_key(session, job_id)
        assert items["a"].status == "succeeded" and items["a"].outputs == {
            "labels": [{"label": "cat", "score": 0.5}]
        }
        assert (items["b"].status, items["b"].error, items["b"].outputs) == ("failed", "Bad.", None)
        assert (items["c"].status, items["d"].status) == ("running", "pending")
        assert items["a"].duration_ms == 2.5 and items["a"].finished_at is not None
        kept = counters.read(session, job_id)
        assert kept == counters.recount(session, job_id)
        assert (kept.succeeded, kept.failed, kept.open) == (1, 1, 2)


def test_items_a_fallback_took_are_counted_once(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        job_id, ids = job_of(session, ["a", "b", "c"])
        leases.take(session, job_id, ids, "run-1", 60)
        results = [
            row("a", answered_by="classifier:1"),
            row("b", answered_by="ocr", fallback_reason="Refused: the top score 0.2 …"),
            row("c", ItemStatus.FAILED, error="Both failed.", outputs=None,
                fallback_reason="The file is not an image Kiln can read."),
        ]  # fmt: skip
        queries.upsert_results(session, job_id, 0, results, owner="run-1")
        queries.upsert_results(session, job_id, 0, results, owner="run-1")  # a replay
        session.commit()
        kept = counters.read(session, job_id)
        assert kept == counters.recount(session, job_id)
        assert (kept.succeeded, kept.failed, kept.fell_back, kept.fell_back_succeeded) == (
            2, 1, 2, 1,
        )  # fmt: skip
        items = by_key(session, job_id)
        assert (items["b"].answered_by, items["b"].fallback_reason) == (
            "ocr", "Refused: the top score 0.2 …",
        )  # fmt: skip
