"""SQLAlchemy 2.0 models: what a job *is*, stored in the source of truth."""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# SQLite only auto-increments a column declared exactly INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def utcnow() -> datetime:
    return datetime.now(UTC)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; everything Kiln stores is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ItemStatus(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


OPEN_JOB_STATUSES = (JobStatus.QUEUED, JobStatus.RUNNING, JobStatus.CANCELLING)
OPEN_ITEM_STATUSES = (ItemStatus.PENDING, ItemStatus.RUNNING)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TenantBucket(Base):
    """An S3 bucket a tenant may name (inputs, bulk sources, outputs, model files).

    No row for a tenant means no S3 access at all; uploads still work.
    """

    __tablename__ = "tenant_buckets"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    bucket: Mapped[str] = mapped_column(String(255), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


SHARED_TENANT = ""  # a model registered for every tenant (by an operator, with the CLI)


class Model(Base):
    """One version of a registered ONNX model (built-in models live in code, see `app.catalog`).

    `name` alone means its latest version; `name:version` pins one.
    """

    __tablename__ = "model_versions"
    __table_args__ = (
        UniqueConstraint("tenant", "name", "version", name="uq_model_versions_tenant_name"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128), default=SHARED_TENANT)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer, default=1)
    kind: Mapped[str] = mapped_column(String(32))
    source: Mapped[str | None] = mapped_column(String(2048))
    onnx_key: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str] = mapped_column(String(64))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class EngineReport(Base):
    """Which backend a worker runs a model on, and why: written when the worker loads it."""

    __tablename__ = "engine_reports"

    node: Mapped[str] = mapped_column(String(255), primary_key=True)
    model: Mapped[str] = mapped_column(String(160), primary_key=True)
    backend: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text)
    device: Mapped[str] = mapped_column(String(255))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WorkerFacts(Base):
    """What a live worker runs, upserted every few seconds (workers/ops/facts.py) and read by the
    console's fleet page (app/api/fleet.py); a row not seen for a while is a worker that is gone."""

    __tablename__ = "worker_facts"

    worker: Mapped[str] = mapped_column(String(255), primary_key=True)  # Celery node name
    host: Mapped[str] = mapped_column(String(255))
    device: Mapped[str] = mapped_column(String(255))  # "cpu", or the GPU's name
    facts: Mapped[dict[str, Any]] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    seen_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)


class ChunkRun(Base):
    """A chunk run in progress: how many of its rows are answered but not yet written, upserted
    by its worker's lease keeper every tick (workers/ops/keeper.py) and deleted with the run's
    results (or by the reconciler once stale), so a job's progress moves between its chunks'
    commits."""

    __tablename__ = "chunk_runs"

    owner: Mapped[str] = mapped_column(String(64), primary_key=True)  # the run's lease token
    job_id: Mapped[str] = mapped_column(String(36), index=True)
    answered: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ContentCache(Base):
    """A result keyed by scope (a tenant, or shared), model version and input bytes: the same
    input is never run twice. `model_key` is "<scope>/<model cache key>"
    (kiln.workers.chunk.content_cache.scope_key); entries expire and are purged oldest first."""

    __tablename__ = "content_cache"
    __table_args__ = (Index("ix_content_cache_created", "created_at"),)  # expiry and eviction

    model_key: Mapped[str] = mapped_column(String(255), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    outputs: Mapped[dict[str, Any]] = mapped_column(JSON)
    vector: Mapped[bytes | None] = mapped_column(LargeBinary)  # raw little-endian floats
    vector_dtype: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency"),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_tenant_status", "tenant", "status"),  # the open-jobs quota's count
        # A job found by its id's first characters (`kiln status 4665f751`): a range read.
        Index(
            "ix_jobs_tenant_id_prefix", "tenant", "id", postgresql_ops={"id": "varchar_pattern_ops"}
        ),
        Index("ix_jobs_retry_of", "retry_of"),  # a job's retries, named in its answer
        Index("ix_jobs_expires_at", "expires_at"),  # the retention sweep's scan
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.QUEUED)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    error: Mapped[str | None] = mapped_column(Text)
    chunk_count: Mapped[int] = mapped_column(Integer, default=0)
    queue: Mapped[str] = mapped_column(String(16), default="interactive")
    # Bulk jobs: the listed source {"s3", "include", "exclude"}, the user's results prefix, and
    # the incremental pipeline this run belongs to.
    source: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    output: Mapped[str | None] = mapped_column(String(2048))
    pipeline_id: Mapped[int | None] = mapped_column(ForeignKey("pipelines.id", ondelete="SET NULL"))
    schedule: Mapped[str | None] = mapped_column(String(128))  # the schedule that started it
    # The completion webhook it asked for: {"url", "events"} (its deliveries: WebhookDelivery).
    notify: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    retry_of: Mapped[str | None] = mapped_column(String(36))  # the job whose failures it replays
    # Retention: when its items and results go (null: kept), when the sweep took them, and the
    # one-row summary (counts, outputs' place) the job keeps after.
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    retention_s: Mapped[int | None] = mapped_column(Integer)  # its own `expires_after`, if any
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookDelivery(Base):
    """One event of a job to send to its webhook, kept until a receiver accepts it (or the
    retries give up), so a worker or API restart loses none. Its id is the delivery id the
    receiver de-duplicates by; one row per (job, event)."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("job_id", "event", name="uq_webhook_deliveries_job_event"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    tenant: Mapped[str] = mapped_column(String(128))
    event: Mapped[str] = mapped_column(String(32))  # completed, failed or cancelled
    url: Mapped[str] = mapped_column(String(2048))
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # delivered, gave_up
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_status: Mapped[int | None] = mapped_column(Integer)  # the receiver's HTTP status
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TenantSettings(Base):
    """An operator's per-tenant defaults (`kiln admin tenant set`): the webhook every job of
    the tenant reports to unless it names its own, how long its jobs' results are kept, and its
    weight in the bulk queue's fair share. No row: the deployment's defaults."""

    __tablename__ = "tenant_settings"

    tenant: Mapped[str] = mapped_column(String(128), primary_key=True)
    notify_url: Mapped[str | None] = mapped_column(String(2048))
    notify_events: Mapped[list[Any] | None] = mapped_column(JSON)
    retention_s: Mapped[int | None] = mapped_column(Integer)
    share_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Item(Base):
    __tablename__ = "items"
    __table_args__ = (
        UniqueConstraint("job_id", "key", name="uq_items_job_key"),
        Index("ix_items_job_status", "job_id", "status"),
        Index("ix_items_status_lease", "status", "lease_expires_at"),  # the reconciler's scan
        Index("ix_items_job_finished", "job_id", "finished_at"),  # a job's rate over a window
        # A job's videos and their frames in time order (the console's strips): frames only.
        Index(
            "ix_items_job_frames",
            "job_id",
            "source",
            "frame_time_s",
            postgresql_where=text("frame_time_s IS NOT NULL"),
            sqlite_where=text("frame_time_s IS NOT NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(1024))
    source: Mapped[str | None] = mapped_column(String(2048))
    etag: Mapped[str | None] = mapped_column(String(128))  # of a listed object (bulk jobs)
    text: Mapped[str | None] = mapped_column(Text)
    # The input's sha256 once a worker has read it (results' `sha256`, exact-duplicate groups).
    sha256: Mapped[str | None] = mapped_column(String(64))
    chunk: Mapped[int] = mapped_column(Integer, default=0)
    # A video's sampled frame: its index in the video and the moment it stands for (seconds;
    # its key ends `#t=<that>`); its source is the video's. Null for any other item.
    frame_index: Mapped[int | None] = mapped_column(Integer)
    frame_time_s: Mapped[float | None] = mapped_column()
    status: Mapped[str] = mapped_column(String(16), default=ItemStatus.PENDING)
    error: Mapped[str | None] = mapped_column(Text)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    outputs: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    duration_ms: Mapped[float | None] = mapped_column()
    # The model ref whose outputs these are (the job's, or its fallback's); null when it failed.
    answered_by: Mapped[str | None] = mapped_column(String(160))
    # Why the job's model did not answer, for an item its fallback answered or also failed.
    fallback_reason: Mapped[str | None] = mapped_column(Text)
    # Milliseconds per worker stage (fetch, decode, engine, post): interactive items only.
    stages_ms: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A running item is leased: `lease_owner` (one chunk run) holds it until `lease_expires_at`,
    # extended while the run lives; the reconciler re-sends items whose lease ran out.
    lease_owner: Mapped[str | None] = mapped_column(String(36))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    queued_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), default=utcnow)


class JobCounter(Base):
    """Item counts of a job by final status, kept as it runs: `GET /v1/jobs/{id}` sums a few
    rows instead of counting the job's items, whatever its size.

    A job's counts are spread over `COUNTER_SLOTS` rows (a chunk adds to slot `chunk %
    COUNTER_SLOTS`), so chunks finishing at once on many workers do not queue on one row.
    Every change to an item's final status adds to its slot in the same transaction; open
    items are `total` minus the rest. `kiln admin recount` compares them with the items.
    """

    __tablename__ = "job_counters"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    total: Mapped[int] = mapped_column(BigInteger, default=0)
    succeeded: Mapped[int] = mapped_column(BigInteger, default=0)
    failed: Mapped[int] = mapped_column(BigInteger, default=0)
    cancelled: Mapped[int] = mapped_column(BigInteger, default=0)
    # Items the job's fallback model took, and of those the ones it answered.
    fell_back: Mapped[int] = mapped_column(BigInteger, default=0)
    fell_back_succeeded: Mapped[int] = mapped_column(BigInteger, default=0)


COUNTER_SLOTS = 16


class Ingest(Base):
    """A bulk job's listing: how far it got, so a crashed ingest resumes after the last key."""

    __tablename__ = "ingests"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    cursor: Mapped[str | None] = mapped_column(String(1024))  # last key listed and committed
    done: Mapped[bool] = mapped_column(Boolean, default=False)
    listed: Mapped[int] = mapped_column(Integer, default=0)  # objects matching the filters
    excluded: Mapped[int] = mapped_column(Integer, default=0)  # objects the filters left out
    skipped: Mapped[int] = mapped_column(Integer, default=0)  # unchanged since the last run
    # unchanged, and failed with this model version before: kept, not retried
    known_failed: Mapped[int] = mapped_column(Integer, default=0)
    deleted: Mapped[int] = mapped_column(Integer, default=0)  # gone since the last run
    retry_failed: Mapped[bool] = mapped_column(Boolean, default=False)  # asked: retry them
    chunks_sent: Mapped[int] = mapped_column(Integer, default=0)
    owner: Mapped[str | None] = mapped_column(String(36))  # the ingest step holding it
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    pages: Mapped[int] = mapped_column(Integer, default=0)


class Pipeline(Base):
    """A named source + model: reruns process only new or changed objects."""

    __tablename__ = "pipelines"
    __table_args__ = (UniqueConstraint("tenant", "name", name="uq_pipelines_tenant_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(128))
    source: Mapped[dict[str, Any]] = mapped_column(JSON)
    model: Mapped[str] = mapped_column(String(160))  # as asked: `name` follows the latest version
    output: Mapped[str | None] = mapped_column(String(2048))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class PipelineObject(Base):
    """One object a pipeline has seen: its ETag, the ETag and model it last succeeded with,
    and the ETag and model it last failed with (the input's own failure: a rerun keeps it)."""

    __tablename__ = "pipeline_objects"

    pipeline_id: Mapped[int] = mapped_column(
        ForeignKey("pipelines.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(1024), primary_key=True)
    etag: Mapped[str] = mapped_column(String(128))
    seen_job: Mapped[str] = mapped_column(String(36))
    done_etag: Mapped[str | None] = mapped_column(String(128))
    done_model: Mapped[str | None] = mapped_column(String(160))
    failed_etag: Mapped[str | None] = mapped_column(String(128))
    failed_model: Mapped[str | None] = mapped_column(String(160))


class Schedule(Base):
    """A cron-timed run of a pipeline (its name is the pipeline's), started by `kiln beat`."""

    __tablename__ = "schedules"
    __table_args__ = (UniqueConstraint("tenant", "name", name="uq_schedules_tenant_name"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(128))
    cron: Mapped[str] = mapped_column(String(128))
    source: Mapped[dict[str, Any]] = mapped_column(JSON)
    model: Mapped[str] = mapped_column(String(160))
    output: Mapped[str | None] = mapped_column(String(2048))
    # The job options every run is submitted with (checked against the family when added).
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    # Every run retries the pipeline's known failures (else only new or changed objects run).
    retry_failed: Mapped[bool] = mapped_column(Boolean, default=False)
    next_run_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_job_id: Mapped[str | None] = mapped_column(String(36))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
