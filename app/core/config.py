"""Kiln's one settings object: every knob comes from `KILN_*` environment variables.

`Settings` is read from the environment once per `get_settings()`; its fields are declared in
themed groups below (plain pydantic models with their validators) that it inherits, so every
variable keeps its `KILN_` name and every caller its `settings.<name>`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kiln.app.core.durations import LONGEST_S, optional_duration

# Rows per engine call under KILN_MAX_BATCH=auto: on a CPU the knee measured with the bench's
# models (docs/capacity.md); on a GPU the most a model's warm-up sweep may choose.
CPU_BATCH = 16
GPU_BATCH_LIMIT = 256


class StackSettings(BaseModel):
    """Where state lives and how a process reaches it: the database, broker and store (the
    embedded stack under `data_dir` where no URL is set), and the API for the CLI."""

    data_dir: Path = Field(Path(".kiln"), description="Where the embedded defaults keep state.")
    database_url: str = Field("", description="SQLAlchemy URL; default SQLite under data_dir.")
    broker_url: str = Field("", description="Celery broker; default kombu's filesystem transport.")
    storage_url: str = Field("", description="s3://bucket/prefix or file:///path.")
    s3_endpoint_url: str | None = Field(
        None, description="MinIO or another S3-compatible endpoint."
    )
    s3_region: str = "us-east-1"
    db_pool_size: int = Field(10, ge=1, le=1000, description="Connections kept per process.")
    db_max_overflow: int = Field(20, ge=0, le=1000, description="Extra connections in bursts.")
    db_pool_timeout_s: float = Field(30.0, gt=0, description="Wait for a free connection.")
    model_cache_dir: Path | None = None
    api_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        return database_url(value) if value else value

    @model_validator(mode="after")
    def _fill_embedded_defaults(self) -> Self:
        data_dir = self.data_dir.expanduser().resolve()
        self.data_dir = data_dir
        for name, default in embedded_urls(data_dir).items():
            if not getattr(self, name):
                setattr(self, name, default)
        if self.model_cache_dir is None:
            self.model_cache_dir = data_dir / "models"
        return self

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr() and str() end up in logs and tracebacks: never a key or a password.
        for name, value in super().__repr_args__():
            if name == "api_key" and value:
                yield name, "***"
            elif isinstance(value, str) and name and name.endswith("_url"):
                yield name, redact_url(value)
            else:
                yield name, value

    def embedded(self) -> Self:
        """These settings on the embedded stack under `data_dir` (SQLite, the local folder
        store, kombu's filesystem broker), whatever KILN_DATABASE_URL, KILN_BROKER_URL and
        KILN_STORAGE_URL say: what `kiln run` always runs on, as it reads local files that
        only its own worker may open. Fair share is off: one user's run has no other tenant to
        share with, and its top-ups would only cost it time (8% of `kiln run`'s rate, measured).
        Every other setting is kept."""
        return self.model_copy(update={**embedded_urls(self.data_dir), "fair_share": False})

    @property
    def embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem:")

    @property
    def broker_dir(self) -> Path:
        return self.data_dir / "broker"


class EngineSettings(BaseModel):
    """How a model runs: the backend, its batches, deadlines, memory and the GPU's options."""

    max_batch: Annotated[int, Field(ge=1, le=4096)] | Literal["auto"] = Field(
        "auto",
        description="Rows per engine call; auto = per model when it loads: on a GPU the knee "
        "of a short sweep (16 to 256), on a CPU 16.",
    )
    max_delay_ms: float = Field(10.0, ge=0, le=60_000)
    runners: int = Field(
        0, ge=0, le=64, description="Engine runner threads per model; 0 = one per core on CPU."
    )
    engine_threads: int = Field(0, ge=0, description="ONNX Runtime intra-op threads; 0 = auto.")
    engine: Literal["auto", "tensorrt", "onnxruntime-cuda", "torch-cuda", "onnxruntime-cpu"] = (
        Field(
            "auto",
            description="Inference backend; auto = per model, the best that builds: TensorRT, "
            "ORT CUDA, PyTorch CUDA, ORT CPU.",
        )
    )
    # Engines on a long-lived fleet (docs/gpu.md): a build that fails falls back to the next
    # backend and is not tried again for engine_retry_s (doubling per failure, at most a day).
    engine_retry_s: float = Field(
        600.0, gt=0, description="Wait before a failed engine build is tried again (doubles)."
    )
    batch_deadline_s: float = Field(
        300.0,
        gt=0,
        description="A batch running longer has wedged: its rows fail as transient errors and "
        "the worker reports itself unhealthy (generous: a cold TensorRT engine's first batch).",
    )
    batch_deadlines: dict[str, float] = Field(
        default_factory=dict,
        description='Per-model batch deadlines, by name or name:version (JSON: {"ocr": 600}).',
    )
    device_memory_budget: str = Field(
        "0.8",
        pattern=r"^\s*(0?\.\d+|1(\.0*)?|\d+\s*([KMGT]i?B|B)?)\s*$",
        description="Models loaded per worker: a fraction of the device's memory (0.8) or a size "
        "(24GiB); idle models beyond it are unloaded, least recently used first.",
    )
    model_idle_s: float = Field(
        600.0,
        ge=0,
        description="A loaded model no chunk has used this long is unloaded, on any device "
        "(its memory and shared-memory slots given back); 0: kept until the budget needs room.",
    )
    oom_recovery_s: float = Field(
        300.0, gt=0, description="Quiet time after an out-of-memory batch before the cap grows."
    )
    gpu_decode: bool | Literal["auto"] = Field(
        "auto",
        description="On the PyTorch CUDA engine, decode JPEGs on the GPU (nvJPEG) a batch at a "
        "time; false: the prep processes decode on the CPU; auto: the GPU wherever nvJPEG is "
        "there (why: docs/gpu.md).",
    )
    jpeg_decoder: Literal["auto", "nvimgcodec", "torchvision"] = Field(
        "auto",
        description="The GPU's JPEG decoder: nvimgcodec (nvImageCodec, a decoder per thread), "
        "torchvision (its nvJPEG, one per process); auto: the first that works, in that order.",
    )
    device_pipeline: Literal["staged", "serial"] = Field(
        "staged",
        description="Where images decode on the GPU: staged runs decode, fit, forward and the "
        "copy back as overlapped stages (docs/gpu.md); serial runs them one after another on "
        "each runner thread.",
    )
    decode_threads: int = Field(
        2, ge=1, le=16, description="Decode stage threads (for a decoder with per-thread state)."
    )
    device_standin: Literal["h200"] | None = Field(
        None,
        description="Benches and tests only: image models take a GPU host's path (decode, fit, "
        "forward on the device) with the device's work replaced by a calibrated stand-in "
        "(docs/gpu.md); its results are zeros, never real.",
    )
    device_standin_report: Path | None = Field(
        None, description="Where the device stand-in writes what it measured (JSON; benches)."
    )
    precision: Literal["auto", "fp16", "fp32"] = Field(
        "auto", description="TensorRT and torch precision; auto = FP16 where the GPU does it fast."
    )
    cuda_graphs: bool = Field(
        True,
        description="On the PyTorch CUDA engine, replay a CUDA graph per batch bucket (powers of "
        "two) for fixed-shape models; false: every batch runs eagerly.",
    )

    def batch_cap(self, on_gpu: bool) -> int:
        """The largest batch an engine is built for: `max_batch`, or under auto the most a
        sweep may choose on a GPU and the measured knee on a CPU."""
        if self.max_batch != "auto":
            return self.max_batch
        return GPU_BATCH_LIMIT if on_gpu else CPU_BATCH

    def decode_on_gpu(self) -> bool:
        """Whether a GPU engine that can decode JPEGs should (auto: yes; why: docs/gpu.md)."""
        return self.gpu_decode is not False

    @property
    def max_delay_s(self) -> float:
        return self.max_delay_ms / 1000.0


class WorkerSettings(BaseModel):
    """How a worker takes its work: chunk sizes, prep processes, chunks in flight."""

    chunk_size: int = Field(
        32, ge=1, le=10_000, description="Items per chunk (one message) of an interactive job."
    )
    bulk_chunk_size: int = Field(
        512,
        ge=1,
        le=10_000,
        description="Items per chunk of a bulk job (over 256 items, or a bucket): fewer, larger "
        "chunks spread each chunk's fixed cost (lease, results, shard, message) thinner.",
    )
    prep_processes: Annotated[int, Field(ge=0, le=1024)] | Literal["auto"] = Field(
        "auto",
        description="Processes that fetch and decode inputs for each worker; auto = one per "
        "core (split between GPUs under --devices all); 0 = none, on the chunk's own thread.",
    )
    run_max_s: float = Field(
        3600.0, gt=0, description="Longest a chunk run may hold its lease, renewals included."
    )
    worker_concurrency: int = Field(
        0,
        ge=0,
        le=1024,
        description="Chunks in flight per worker (task threads); 0 = enough to keep four "
        "batches of the largest batch queued: ceil(4 × batch / bulk chunk) + 1, at least 16.",
    )

    def prep_count(self, cores: int) -> int:
        """Prep processes for a worker on `cores` cores (0: prep on the chunk's thread)."""
        return cores if self.prep_processes == "auto" else self.prep_processes


class DeliverySettings(BaseModel):
    """How work travels and is never lost: bulk listing, the broker, item leases, the
    reconciler's re-sends and beat's ticks."""

    # Bulk jobs: listing in pages, at most this many chunks in the queue or running per job, so
    # Redis never holds a bucket's worth of messages and interactive work is not starved.
    ingest_page_size: int = Field(1000, ge=1, le=1000, description="Keys per S3 list call.")
    ingest_pages_per_step: int = Field(20, ge=1, description="Pages listed per ingest task.")
    bulk_max_chunks: int = Field(64, ge=1, description="Chunks outstanding per bulk job.")
    # An estimate (POST /v1/jobs/estimate) lists at most this much before it samples (and as
    # much again for the sample), and reads the headers of this many videos.
    estimate_max_objects: int = Field(
        100_000, ge=1, description="Objects an estimate lists before it samples sub-folders."
    )
    estimate_budget_s: float = Field(
        20.0, gt=0, description="Seconds an estimate lists before it samples sub-folders."
    )
    estimate_video_samples: int = Field(
        20, ge=0, description="Videos whose headers an estimate reads for their frames."
    )
    estimate_header_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Bytes an estimate reads of one video's header."
    )
    # Fair share (app/jobs/fair_share.py): bulk chunks sent and unfinished, fleet-wide, are
    # capped at this many per task thread of each live worker; each tenant with open bulk work
    # gets its weighted share of that window, the rest of its chunks wait unsent.
    fair_share: bool = Field(
        True,
        description="Send bulk chunks by the tenants' fair share; false = every recorded chunk "
        "at once (one FIFO: a tenant's backlog runs before a later tenant's job).",
    )
    fair_share_window_per_slot: int = Field(
        2,
        ge=1,
        le=64,
        description="Bulk chunks in flight per worker task thread, shared fairly by tenants.",
    )
    ingest_stale_s: float = Field(
        60.0, gt=0, description="An ingest silent this long is taken over by the reconciler."
    )
    visibility_timeout_s: float = Field(
        3600.0, gt=0, description="Redis redelivers a message unacknowledged this long."
    )
    reconcile_interval_s: float = Field(15.0, gt=0, description="How often beat reconciles.")
    # Item leases: a chunk run holds its items for lease_s, renewed every lease_renew_s while it
    # lives; the reconciler re-sends items whose lease ran out (a killed worker, a lost message).
    lease_s: float = Field(60.0, gt=0, description="How long a chunk run holds its items.")
    lease_renew_s: float = Field(
        3.0, gt=0, description="How often a running chunk renews its lease."
    )
    cancel_check_s: float = Field(
        1.0, gt=0, description="How often a worker looks whether its running jobs were cancelled."
    )
    redispatch_after_s: float = Field(
        60.0, gt=0, description="A pending item with no message in the broker this long is re-sent."
    )
    max_attempts: int = Field(
        20, ge=1, description="Runs of one item before it fails (crashes, lost leases, retries)."
    )
    schedule_tick_s: float = Field(20.0, gt=0, description="How often beat looks for due runs.")
    # Retention (app/jobs/retention.py): how long a closed job's items and results are kept
    # (unset: for ever), and the most a tenant's setting or a job's `expires_after` may ask.
    retention: int | None = Field(
        None,
        description='Seconds, or "7d"/"12h", a job\'s items and results are kept after it ends '
        "(unset or none: kept); a tenant's setting or the job's expires_after overrides it.",
    )
    retention_max: int | None = Field(
        None, description="The longest retention a tenant or a job may ask (unset: no limit)."
    )
    retention_sweep_rows: int = Field(
        20_000, ge=1, description="Item rows the retention sweep deletes per beat tick, at most."
    )

    @field_validator("retention", "retention_max", mode="before")
    @classmethod
    def _duration(cls, value: object) -> int | None:
        seconds = optional_duration(value)
        if seconds is not None and seconds <= 0:
            raise ValueError("a retention must be longer than zero (unset it to keep for ever)")
        if seconds is not None and seconds > LONGEST_S:
            raise ValueError("a retention is at most 3650d (unset it to keep for ever)")
        return seconds

    @model_validator(mode="after")
    def _retention_within_max(self) -> Self:
        if self.retention and self.retention_max and self.retention > self.retention_max:
            raise ValueError("KILN_RETENTION is longer than KILN_RETENTION_MAX")
        return self

    filesystem_polling_ms: float = Field(20.0, gt=0, description="Embedded broker poll interval.")


class LimitSettings(BaseModel):
    """What one input, job or model may be, and whether workers may read local files."""

    max_upload_bytes: int = Field(50 * 1024 * 1024, ge=1)
    max_video_frames: int = Field(
        100_000, ge=1, description="Frames a job may sample from one video (video_fps × length)."
    )
    max_video_duration_s: float = Field(
        24 * 3600.0, gt=0, description="Longest video a job takes, as its header says."
    )
    max_files_per_job: int = Field(1000, ge=1)
    max_model_bytes: int = Field(1024**3, ge=1, description="Largest ONNX file registered.")
    max_image_pixels: int = Field(50_000_000, ge=1, description="Decompression-bomb cap.")
    local_inputs: bool = Field(
        False, description="Workers may read file:// inputs (set by `kiln run`, never the API)."
    )


class CacheSettings(BaseModel):
    """The content cache (a result reused by input hash) and the API's search index cache."""

    content_cache: bool = Field(
        True, description="Reuse a result for an input (by sha256) this model version has seen."
    )
    # Per tenant by default: a hit is visibly faster, so a shared cache would tell one tenant
    # that another already processed the same bytes.
    content_cache_shared: bool = Field(
        False, description="One content cache for every tenant instead of one per tenant."
    )
    content_cache_ttl_s: float = Field(
        7 * 24 * 3600.0, gt=0, description="A cached result is used and kept this long."
    )
    content_cache_max_entries: int = Field(
        1_000_000, ge=1, description="Above this many cached results the oldest are evicted."
    )
    # The API's memory limit is 1 GiB (deploy/base/api.yaml); half of it holds one index of
    # ~180,000 512-d vectors (100,000 count 283 MiB). Raise both together for larger jobs.
    search_cache_bytes: int = Field(
        512 * 1024**2,
        ge=1,
        description="Vector indexes the API keeps loaded for search, in bytes; a job whose "
        "index is larger cannot be searched.",
    )


class ApiSettings(BaseModel):
    """The API's guards per tenant, its search wait and the console's session cookies."""

    tenant_rate_limit: str = Field(
        "100/second",
        description="Requests per tenant on authenticated routes, as `limits` parses it "
        "('100/second', '5000/minute'); over it the API answers 429 with Retry-After.",
    )
    tenant_max_open_jobs: int = Field(
        1000, ge=1, description="Jobs queued, running or cancelling at once per tenant."
    )
    search_wait_s: float = Field(
        30.0, gt=0, le=600, description="How long a search waits for a worker to embed its query."
    )

    console_secret: SecretStr | None = Field(
        None,
        description="Signs the console's session cookies (32+ characters); give every API "
        "replica the same one. Unset: a random one per process (a restart signs everyone out).",
    )
    console_secure_cookie: bool = Field(
        False,
        description="Send the console's session cookie over HTTPS only (set it behind TLS).",
    )

    @field_validator("console_secret")
    @classmethod
    def _long_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("KILN_CONSOLE_SECRET must be at least 32 characters")
        return value

    @field_validator("tenant_rate_limit")
    @classmethod
    def _parse_rate(cls, value: str) -> str:
        from limits import parse_many

        try:
            parse_many(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a rate like '100/second' or '5000/min'") from None
        return value


class WebhookSettings(BaseModel):
    """Completion webhooks (workers/webhooks): who may be called, how they are signed, and how
    long a delivery is retried."""

    webhook_secret: SecretStr | None = Field(
        None,
        description="The deployment's signing secret (16+ characters); each tenant's secret "
        "is derived from it (`GET /v1/webhooks/secret`). Unset: jobs may not ask for webhooks.",
    )
    webhook_allow_private: bool = Field(
        False,
        description="Let webhooks call private, loopback, link-local and reserved addresses "
        "(a receiver on the same network; off: an API user could probe the inside).",
    )
    webhook_timeout_s: float = Field(10.0, gt=0, le=60, description="One delivery's HTTP wait.")
    # Standard Webhooks' schedule: the waits after each failed attempt; past the last, gave_up.
    # NoDecode: the environment's text reaches `_waits` as it is (pydantic-settings would read
    # it as JSON first, and refuse the commas the description offers).
    webhook_backoff_s: Annotated[list[float], NoDecode] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0],
        min_length=1,
        description="Seconds before each retry of a failed delivery: a JSON list or commas "
        "(`5,300,1800`).",
    )
    webhook_concurrency: int = Field(
        16, ge=1, le=256, description="Deliveries a worker sends at once."
    )
    webhook_lease_s: float = Field(
        60.0,
        gt=0,
        description="A claimed delivery is the claimer's this long; a killed sender's is then "
        "claimed again (keep it above the timeout).",
    )
    webhook_sweep_s: float = Field(
        10.0, gt=0, description="How often beat (and each sending worker) looks for due deliveries."
    )

    @field_validator("webhook_backoff_s", mode="before")
    @classmethod
    def _waits(cls, value: object) -> object:
        """A list as text (an environment's): JSON, or numbers separated by commas."""
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _long_webhook_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("KILN_WEBHOOK_SECRET must be at least 16 characters")
        return value


class ObservabilitySettings(BaseModel):
    """What every process tells about itself: logs, traces, the worker's metrics port."""

    worker_metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Prometheus port of `kiln worker`; unset = off."
    )
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="Log lines: JSON objects, text, or auto (text on a terminal)."
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] | None = Field(
        None,
        description="Lowest level logged; unset = info for the services (a --loglevel flag "
        "wins), warning for `kiln run` (its bar says the rest).",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP collector for traces (e.g. http://collector:4318); unset = the "
        "standard OTEL_EXPORTER_OTLP_ENDPOINT, and with neither tracing is off.",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value  # INFO as info


# The groups are listed last-first: pydantic orders the fields from the last base up, so a
# repr (in logs) starts with the stack as the groups above do.
class Settings(
    ObservabilitySettings,
    WebhookSettings,
    ApiSettings,
    CacheSettings,
    LimitSettings,
    DeliverySettings,
    WorkerSettings,
    EngineSettings,
    StackSettings,
    BaseSettings,
):
    """Validated configuration. Build it with `get_settings()`; nothing here connects."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    @property
    def task_threads(self) -> int:
        """Chunks in flight per worker: four batches' worth of bulk chunks, and at least 16,
        so one-image jobs still fill a batch. It does not grow with the batch: a chunk's rows
        are blocks, and threads wait on them rather than on a row each."""
        batch = self.batch_cap(on_gpu=True)
        return self.worker_concurrency or max(16, math.ceil(4 * batch / self.bulk_chunk_size) + 1)


def embedded_urls(data_dir: Path) -> dict[str, str]:
    """The database, broker and store of the embedded stack under `data_dir`: the defaults
    where no URL is set, and all of `kiln run`'s."""
    return {
        "database_url": f"sqlite:///{data_dir / 'kiln.db'}",
        "broker_url": "filesystem://localhost/",
        "storage_url": (data_dir / "objects").as_uri(),
    }


DATABASE_EXAMPLE = "postgresql+psycopg://user:password@host:5432/kiln"


def database_url(value: str) -> str:
    """A database URL Kiln runs on: PostgreSQL through psycopg 3 (`postgres://` and a bare
    `postgresql://`, as hosting providers write them, mean that driver, the one Kiln ships) or
    SQLite. Anything else is refused with what Kiln takes."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(value)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise ValueError(
            f"not a database URL; Kiln takes one like {DATABASE_EXAMPLE} (or sqlite:///path)"
        ) from None
    if url.drivername in ("postgres", "postgresql"):
        # the scheme alone is rewritten: the rest stays as written (a rendered URL would
        # percent-encode a path or an option the user wrote plainly)
        return "postgresql+psycopg" + value[len(url.drivername) :]
    if url.get_backend_name() not in ("postgresql", "sqlite"):
        raise ValueError(
            f"Kiln runs on PostgreSQL or SQLite, not {url.get_backend_name()}; "
            f"e.g. {DATABASE_EXAMPLE}"
        )
    if url.get_backend_name() == "postgresql" and url.get_driver_name() != "psycopg":
        raise ValueError(
            f"Kiln reaches PostgreSQL through psycopg 3: write postgresql+psycopg://… "
            f"(not {url.drivername}://…)"
        )
    return value


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, fit for a log line."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def get_settings(**overrides: object) -> Settings:
    """Read the environment (plus explicit overrides) into a fresh `Settings`."""
    return Settings(**overrides)  # type: ignore[arg-type]
