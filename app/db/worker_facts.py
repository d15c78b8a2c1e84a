"""Worker facts in the database: a worker upserts its row every few seconds and deletes it when
it stops; the fleet page reads the rows seen recently (a worker killed without a goodbye ages
out)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from kiln.app.db import dialect
from kiln.app.db.models import WorkerFacts, utcnow


def publish(
    session: Session, worker: str, host: str, device: str, facts: dict[str, Any],
    started_at: datetime,
) -> None:  # fmt: skip
    """Upsert what `worker` runs now."""
    values = {"worker": worker, "host": host, "device": device, "facts": facts,
              "started_at": started_at, "seen_at": utcnow()}  # fmt: skip
    statement = dialect.insert(session, WorkerFacts).values(values)
    session.execute(
        statement.on_conflict_do_update(
            index_elements=[WorkerFacts.worker],
            set_={k: statement.excluded[k] for k in values if k != "worker"},
        )
    )


def forget(session: Session, worker: str) -> None:
    """A worker that stops says so, rather than lingering until its row ages out."""
    session.execute(delete(WorkerFacts).where(WorkerFacts.worker == worker))


def any_seen_since(session: Session, since: datetime) -> bool:
    """Whether any worker reported at or after `since`."""
    query = select(WorkerFacts.worker).where(WorkerFacts.seen_at >= since).limit(1)
    return session.scalar(query) is not None


def seen_since(session: Session, since: datetime) -> list[WorkerFacts]:
    """Workers that reported at or after `since`, by name."""
    query = select(WorkerFacts).where(WorkerFacts.seen_at >= since).order_by(WorkerFacts.worker)
    return list(session.scalars(query))
