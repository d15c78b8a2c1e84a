"""What the console's pages show, made from the API's own service functions: a job's counts come
from `jobs.progress` (the job's counters, never a count over its items), pages of items from
`queries.list_items` (keyset paging), as `/v1/jobs` answers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from kiln.app import jobs
from kiln.app.catalog import ModelInfo
from kiln.app.db import queries
from kiln.app.db.models import OPEN_JOB_STATUSES, Item, Job

OPEN = {s.value for s in OPEN_JOB_STATUSES}
TOP = 5  # classifier labels shown per item


@dataclass(frozen=True)
class JobView:
    id: str
    model: str
    status: str
    counts: queries.Counts
    items_per_second: float | None
    eta_seconds: float | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    source: dict[str, Any] | None
    error: str | None

    @property
    def open(self) -> bool:
        return self.status in OPEN

    @property
    def done(self) -> int:
        return self.counts.done + self.counts.skipped + self.counts.deleted

    @property
    def percent(self) -> float:
        total = self.counts.total
        return 100.0 * self.done / total if total else (0.0 if self.open else 100.0)

    @property
    def bulk(self) -> bool:
        return self.source is not None


def job_view(session: Session, job: Job) -> JobView:
    report = jobs.progress(session, job)
    return JobView(
        id=job.id,
        model=job.model,
        status=job.status,
        counts=report.counts,
        items_per_second=report.items_per_second,
        eta_seconds=report.eta_seconds,
        created_at=report.created_at,
        started_at=report.started_at,
        finished_at=report.finished_at,
        source=job.source,
        error=job.error,
    )


@dataclass(frozen=True)
class JobsPage:
    jobs: list[JobView]
    next: str | None  # the cursor of the next (older) page


def jobs_page(session: Session, tenant: str, after: str | None, limit: int) -> JobsPage:
    cursor = queries.tenant_job(session, tenant, after) if after else None
    page = queries.list_jobs(session, tenant, after=cursor, limit=limit)
    return JobsPage(
        [job_view(session, job) for job in page], page[-1].id if len(page) == limit else None
    )


@dataclass(frozen=True)
class Box:
    label: str
    score: float


@dataclass
class ItemView:
    key: str
    status: str
    error: str | None
    duration_ms: float | None
    answered_by: str | None
    fallback_reason: str | None
    stages_ms: dict[str, float] = field(default_factory=dict)
    text: str | None = None  # OCR's text, or a text model's input
    labels: list[Box] = field(default_factory=list)  # detections, or a classifier's top labels
    phash: str | None = None
    dim: int | None = None  # an embedding's length (the vector itself is not shown)
    group: int | None = None  # near-duplicate group, once the job has closed


def item_view(item: Item, model: ModelInfo) -> ItemView:
    view = ItemView(
        key=item.key,
        status=item.status,
        error=item.error,
        duration_ms=item.duration_ms,
        answered_by=item.answered_by,
        fallback_reason=item.fallback_reason,
        stages_ms=stages(item),
        text=item.text,
    )
    outputs = item.outputs or {}
    if "detections" in outputs:
        view.labels = [_box(d) for d in outputs["detections"] or []]
    elif "labels" in outputs:
        view.labels = [_box(d) for d in (outputs["labels"] or [])[:TOP]]
    if isinstance(outputs.get("text"), str):
        view.text = outputs["text"]
    if isinstance(outputs.get("phash"), str):
        view.phash = outputs["phash"]
    if isinstance(outputs.get("dim"), int):
        view.dim = outputs["dim"]
    return view


def stages(item: Item) -> dict[str, float]:
    """Milliseconds per stage: waiting in the queue (from the database's times), then what the
    worker recorded for an interactive item (fetch, decode, engine, post)."""
    out: dict[str, float] = {}
    if item.queued_at is not None and item.started_at is not None:
        out["queue"] = round((item.started_at - item.queued_at).total_seconds() * 1000, 1)
    for stage, ms in (item.stages_ms or {}).items():
        if isinstance(ms, int | float):
            out[stage] = float(ms)
    return out


def _box(detection: dict[str, Any]) -> Box:
    return Box(str(detection.get("label", "?")), float(detection.get("score") or 0.0))


@dataclass(frozen=True)
class ItemsPage:
    items: list[ItemView]
    next: int | None  # the cursor of the next page


def items_page(
    session: Session, job: Job, model: ModelInfo, status: str | None, after: int, limit: int
) -> ItemsPage:
    page = queries.list_items(session, job.id, status=status, after=after, limit=limit)
    return ItemsPage(
        [item_view(item, model) for item in page], page[-1].id if len(page) == limit else None
    )
