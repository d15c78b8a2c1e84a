"""What the console's pages show, made from the API's own service functions: a job's counts come
from `jobs.progress` (the job's counters, never a count over its items), pages of items from
`queries.list_items` (keyset paging), as `/v1/jobs` answers them.

A video's sampled frames (items with a `frame_time_s`) are shown apart from the job's other
items: one strip per video, its frames in time order, a page of them at a time (keyset paging
on the frame's time and id), the videos themselves a page at a time in the order their first
frames were made."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.orm import Session

from kiln.app import video
from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db import queries, webhooks
from kiln.app.db.models import OPEN_JOB_STATUSES, Item, ItemStatus, Job, WebhookDelivery
from kiln.app.jobs import job_counts, jobs, retention

OPEN = {s.value for s in OPEN_JOB_STATUSES}
TOP = 5  # classifier labels shown per item
STRIP_FRAMES = 24  # frames a video's strip shows at first, and adds each time more are asked
VIDEOS_PAGE = 10  # videos (strips) shown at first, and added each time more are asked


@dataclass(frozen=True)
class WebhookView:
    """A job's webhook and its deliveries' attempts (the job page's summary)."""

    url: str
    events: list[str]
    deliveries: list[WebhookDelivery]

    @property
    def pending(self) -> bool:
        return any(d.status == "pending" for d in self.deliveries)


def webhook_view(session: Session, job: Job) -> WebhookView | None:
    if not job.notify:
        return None
    found = webhooks.deliveries_of(session, job.id)
    return WebhookView(job.notify.get("url", ""), list(job.notify.get("events") or []), found)


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
    running: int = 0  # items a worker holds now
    answered: int = 0  # of those, answered and not yet written by their chunk
    stalled_since: datetime | None = None  # a worker holding items stopped renewing them
    webhook: WebhookView | None = None  # on the job's own page only (a read more)
    retry_of: str | None = None  # the job whose failed items this one replays
    retries: tuple[str, ...] = ()  # the jobs replaying this one's (read for the job's page)
    expired: bool = False  # retention took its items and results: its counts are a summary

    @property
    def waiting(self) -> int:
        return max(0, self.counts.pending - self.running)

    @property
    def open(self) -> bool:
        return self.status in OPEN

    @property
    def done(self) -> int:
        """Items ended, or answered in a chunk still running: the progress over the total
        (`job_counts`: what the run left alone is shown apart, never in it)."""
        return job_counts.done(self.counts.done, self.answered, self.counts.total)

    @property
    def percent(self) -> float:
        return job_counts.percent(self.done, self.counts.total, closed=not self.open)

    @property
    def left_alone(self) -> list[tuple[str, int]]:
        """(what, how many) of the objects a bulk run's listing left alone."""
        return job_counts.left_alone(asdict(self.counts)) if self.bulk else []

    @property
    def bulk(self) -> bool:
        return self.source is not None


def job_view(session: Session, job: Job, timing: jobs.LeaseTiming) -> JobView:
    report = jobs.progress(session, job, timing, retention.summary_counts(job))
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
        running=report.running,
        answered=report.answered,
        stalled_since=report.stalled_since,
        retry_of=job.retry_of,
        expired=job.summary is not None,
    )


@dataclass(frozen=True)
class JobsPage:
    jobs: list[JobView]
    next: str | None  # the cursor of the next (older) page


def jobs_page(
    session: Session, tenant: str, after: str | None, limit: int, timing: jobs.LeaseTiming
) -> JobsPage:
    cursor = queries.tenant_job(session, tenant, after) if after else None
    page = queries.list_jobs(session, tenant, after=cursor, limit=limit)
    return JobsPage(
        [job_view(session, job, timing) for job in page],
        page[-1].id if len(page) == limit else None,
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
    item_id: int = 0
    frame_index: int | None = None  # a video's frame: its index (None: past the video's end)
    frame_time_s: float | None = None  # ... and the moment it stands for

    @property
    def video(self) -> str:
        """The key of the video a frame is of (the item's own key for any other item)."""
        return video.split_key(self.key, self.frame_time_s)


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
        item_id=item.id,
        frame_index=item.frame_index,
        frame_time_s=item.frame_time_s,
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
    """A page of the job's items other than videos' frames (those are in `video_strips`)."""
    query = select(Item).where(Item.job_id == job.id, Item.id > after, Item.frame_time_s.is_(None))
    if status:
        query = query.where(Item.status == status)
    page = list(session.scalars(query.order_by(Item.id).limit(limit)))
    return ItemsPage(
        [item_view(item, model) for item in page], page[-1].id if len(page) == limit else None
    )


@dataclass
class Strip:
    """One video's frames, in time order: a page of them, and how to ask for the next."""

    video: str  # the video's key (its frames' keys less `#t=`)
    source: str  # where its frames are read from: with `video`, what names the strip
    frames: list[ItemView]
    total: int | None = None  # its frames (of the status shown), where counted
    failed: int | None = None
    more: tuple[float, int] | None = None  # the last frame shown (time, id), when more follow


@dataclass(frozen=True)
class VideosPage:
    strips: list[Strip]
    next: int | None  # the cursor of the next page of videos (the last one's first frame id)


def _frames_of(job_id: str, status: str | None) -> Any:
    """The job's video frames (of `status`)."""
    query = select(Item).where(Item.job_id == job_id, Item.frame_time_s.is_not(None))
    return query.where(Item.status == status) if status else query


def video_strips(
    session: Session,
    job: Job,
    model: ModelInfo,
    status: str | None,
    after: int = 0,
) -> VideosPage:
    """The job's videos whose first frame's id is past `after` (`VIDEOS_PAGE` of them, in
    that order), each with its first `STRIP_FRAMES` frames of `status` in time order."""
    videos, frames = VIDEOS_PAGE, STRIP_FRAMES
    first = func.min(Item.id)
    failed = func.sum(case((Item.status == ItemStatus.FAILED, 1), else_=0))
    counted = (
        _frames_of(job.id, status)
        .with_only_columns(Item.source, first, func.count(), failed)
        .group_by(Item.source)
        .having(first > after)
        .order_by(first)
        .limit(videos)
    )
    listed = session.execute(counted).all()
    if not listed:
        return VideosPage([], None)
    sources = [source for source, *_ in listed]
    rank = (
        func.row_number()
        .over(partition_by=Item.source, order_by=(Item.frame_time_s, Item.id))
        .label("rank")
    )
    ranked = (
        _frames_of(job.id, status)
        .with_only_columns(Item.id, rank)
        .where(Item.source.in_(sources))
        .subquery()
    )
    shown = session.scalars(
        select(Item)
        .join(ranked, Item.id == ranked.c.id)
        .where(ranked.c.rank <= frames)
        .order_by(Item.frame_time_s, Item.id)
    ).all()
    by_source: dict[str | None, list[ItemView]] = {source: [] for source in sources}
    for item in shown:
        by_source[item.source].append(item_view(item, model))
    strips: list[Strip] = []
    for source, _first, total, bad in listed:
        page = by_source[source]
        full = len(page) == frames
        for name, views in _by_video(page).items():  # one source, several keys: rare
            strip = Strip(name, source or "", views, int(total), int(bad or 0))
            strip.more = (views[-1].frame_time_s or 0.0, views[-1].item_id) if full else None
            strips.append(strip)
    last = int(listed[-1][1])
    return VideosPage(strips, last if len(listed) == videos else None)


def _by_video(frames: list[ItemView]) -> dict[str, list[ItemView]]:
    grouped: dict[str, list[ItemView]] = {}
    for frame in frames:
        grouped.setdefault(frame.video, []).append(frame)
    return grouped


def more_frames(
    session: Session,
    job: Job,
    model: ModelInfo,
    status: str | None,
    source: str,
    name: str,
    after: tuple[float, int],
) -> Strip:
    """The next `STRIP_FRAMES` frames of video `name` (read from `source`) after the frame
    `after` (its time and id), in time order."""
    time_s, item_id = after
    limit = STRIP_FRAMES
    page = list(
        session.scalars(
            _frames_of(job.id, status)
            .where(
                Item.source == source,
                Item.key.startswith(name + video.FRAGMENT, autoescape=True),
                or_(
                    Item.frame_time_s > time_s,
                    and_(Item.frame_time_s == time_s, Item.id > item_id),
                ),
            )
            .order_by(Item.frame_time_s, Item.id)
            .limit(limit)
        )
    )
    views = [item_view(item, model) for item in page]
    strip = Strip(name, source, views)
    if len(page) == limit:
        strip.more = (page[-1].frame_time_s or 0.0, page[-1].id)
    return strip
