"""The fleet as a tenant may see it: live workers (from the facts they publish,
workers/ops/facts.py) and the broker's queue lengths. Read by the console's fleet page.

A worker's models are shown to a tenant when they are built-ins or the tenant's own (or shared)
registered models; another tenant's models are only counted, never named."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from kiln.app.db import worker_facts
from kiln.app.db.models import SHARED_TENANT, WorkerFacts, aware, utcnow

LIVE_FOR_S = 30.0  # six missed reports (workers/ops/facts.py publishes every 5 s): gone


@dataclass(frozen=True)
class LiveWorker:
    worker: str
    host: str
    device: str
    facts: dict[str, Any]  # models (only those the tenant may see), problems, memory, capacity, gpu
    started_at: datetime
    seen_at: datetime
    age_s: float  # since its last report
    hidden_models: int  # loaded models of other tenants

    @property
    def gpu(self) -> dict[str, Any] | None:
        """Its GPU's latest NVML sample; None on a CPU worker (or where NVML does not answer)."""
        sample = self.facts.get("gpu")
        return sample if isinstance(sample, dict) else None

    @property
    def memory(self) -> dict[str, int]:
        """Its resident memory, `rss_bytes` and its prep processes' `prep_rss_bytes`: only
        the figures it could read (none from a worker older than them)."""
        memory = self.facts.get("memory")
        return memory if isinstance(memory, dict) else {}


def visible(owner: str, tenant: str) -> bool:
    return owner in (tenant, SHARED_TENANT)


def scoped(row: WorkerFacts, tenant: str, now: datetime) -> LiveWorker:
    """`row` as `tenant` may see it."""
    models = row.facts.get("models", {})
    shown = {
        ref: facts
        for ref, facts in models.items()
        if visible(str(facts.get("tenant", SHARED_TENANT)), tenant)
    }
    seen_at = aware(row.seen_at) or now
    return LiveWorker(
        worker=row.worker,
        host=row.host,
        device=row.device,
        facts={**row.facts, "models": shown},
        started_at=aware(row.started_at) or seen_at,
        seen_at=seen_at,
        age_s=max(0.0, (now - seen_at).total_seconds()),
        hidden_models=len(models) - len(shown),
    )


def any_live(session: Session, max_age_s: float = LIVE_FOR_S) -> bool:
    """Whether any worker reported in the last `max_age_s` (of any tenant: a worker serves
    every tenant's jobs)."""
    return worker_facts.any_seen_since(session, utcnow() - timedelta(seconds=max_age_s))


def live_workers(session: Session, tenant: str, max_age_s: float = LIVE_FOR_S) -> list[LiveWorker]:
    """Workers that reported in the last `max_age_s`, by name."""
    now = utcnow()
    rows = worker_facts.seen_since(session, now - timedelta(seconds=max_age_s))
    return [scoped(row, tenant, now) for row in rows]
