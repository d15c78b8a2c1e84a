"""The API's request and response bodies."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)


def _as_given(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A whole number stays an int once checked as a number, so a sentence that echoes it says
    "not -1.", as it was given, never "not -1.0."."""
    checked = handler(value)
    if isinstance(value, int) and not isinstance(value, bool) and checked == value:
        return value
    return checked


# A JSON number that a check (`video.check_fps`, `model_spec`) may echo in its sentence.
Number = Annotated[float, WrapValidator(_as_given)]


class InputIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(
        None, min_length=1, max_length=2048, examples=["s3://bucket/photos/cat.jpg"]
    )
    text: str | None = Field(None, max_length=100_000)


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class SourceIn(BaseModel):
    """A bucket to process: every object under the prefix that the filters let through."""

    model_config = ConfigDict(extra="forbid")

    s3: str = Field(..., max_length=2048, examples=["s3://photos/2026/"])
    include: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=50, examples=[["*.jpg", "*.png"]]
    )
    exclude: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=50
    )
    case_sensitive: bool = Field(
        False, description="Match the globs in case (by default `*.jpg` also takes `A.JPG`)."
    )


WebhookEvent = Literal["completed", "failed", "cancelled"]
WEBHOOK_EVENTS: tuple[WebhookEvent, ...] = ("completed", "failed", "cancelled")


class NotifyIn(BaseModel):
    """A completion webhook: Kiln POSTs the job's answer to `url` when it ends with one of
    `events`, signed in the Standard Webhooks convention (`webhook-id`, `webhook-timestamp`,
    `webhook-signature`; the tenant's secret: `GET /v1/webhooks/secret`)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(..., min_length=1, max_length=2048, examples=["https://example.com/hook"])
    events: list[WebhookEvent] = Field(
        default_factory=lambda: list(WEBHOOK_EVENTS), min_length=1, max_length=3
    )


class DeliveryOut(BaseModel):
    id: str = Field(description="The delivery id (`webhook-id`): the receiver de-duplicates by it.")
    event: str
    status: str = Field(description="`pending` (retrying), `delivered` or `gave_up`.")
    attempts: int
    last_status: int | None = Field(default=None, description="The receiver's last HTTP status.")
    last_error: str | None = None
    next_attempt_at: datetime | None = None
    delivered_at: datetime | None = None


class NotifyOut(BaseModel):
    url: str
    events: list[str]
    deliveries: list[DeliveryOut] = Field(default_factory=list)


class RetryIn(BaseModel):
    """Replay a job's failed items (and, if asked, its cancelled ones) as a new job."""

    model_config = ConfigDict(extra="forbid")

    include_cancelled: bool = False
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Another model ref (default: the job's).",
    )
    options: dict[str, Any] | None = Field(
        default=None, description="Other options (default: the job's)."
    )
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=256)
    notify: NotifyIn | None = None


class EstimateOut(BaseModel):
    """What a bulk job over a source would take, before it is created (no job is)."""

    objects: int = Field(description="Objects the filters let through (all listed, or sampled).")
    bytes: int
    images: int
    videos: int
    frames: int | None = Field(
        default=None, description="Frames the videos would be sampled into, from their headers."
    )
    items: int = Field(description="Items the job would run: images plus frames (or videos).")
    sampled: bool = Field(description="True when only part of a huge prefix was listed.")
    listed: int = Field(description="Objects actually listed to make the estimate.")
    rate_per_s: float | None = Field(
        default=None,
        description="The fleet's measured items/s for this model (null: never measured).",
    )
    workers: int = Field(description="Workers alive now.")
    seconds: float | None = Field(
        default=None, description="The estimated run time (null: no rate)."
    )
    note: str = Field("", description="How the estimate was made, in a sentence.")


class JobCreate(BaseModel):
    """Either `inputs` (a list of URIs or texts) or a `source` bucket prefix (a bulk job)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, max_length=128, examples=["phash"])
    inputs: list[InputIn] | None = Field(None, min_length=1)
    source: SourceIn | None = None
    pipeline: str | None = Field(
        None, pattern=NAME_PATTERN, description="Name an incremental pipeline (bulk jobs)."
    )
    output: str | None = Field(
        None, max_length=2048, description="s3:// prefix for the results (bulk jobs)."
    )
    options: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)
    video_fps: Number | None = Field(
        None,
        description="Frames sampled per second of each video input (default 1; 0: every frame).",
    )
    retry_failed: bool = Field(
        False,
        description="A pipeline's run: process again the unchanged objects that failed with "
        "this model version before (by default they are kept, counted `known_failed`).",
    )
    notify: NotifyIn | None = Field(
        default=None,
        description="A completion webhook (default: the tenant's, if the operator set one).",
    )
    expires_after: int | str | None = Field(
        default=None,
        description="How long after it ends its items and results are kept: seconds, or a "
        'duration such as "7d", "12h" (default and maximum: the operator\'s).',
    )

    @model_validator(mode="after")
    def _one_kind(self) -> JobCreate:
        if (self.inputs is None) == (self.source is None):
            raise ValueError('give either "inputs" or "source", not both')
        if self.source is None and (self.pipeline or self.output):
            raise ValueError('"pipeline" and "output" go with a "source"')
        if self.retry_failed and not self.pipeline:
            raise ValueError('"retry_failed" goes with a "pipeline" (only its runs keep failures)')
        return self


class ScheduleCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=NAME_PATTERN)
    cron: str = Field(
        ...,
        max_length=128,
        examples=["0 2 * * *", "@daily"],
        description="Five fields (minute hour day-of-month month weekday, UTC) or @hourly, "
        "@daily, @weekly, @monthly, @yearly.",
    )
    model: str = Field(..., min_length=1, max_length=128)
    source: SourceIn
    output: str | None = Field(None, max_length=2048)
    options: dict[str, Any] = Field(default_factory=dict)
    retry_failed: bool = Field(
        False, description="Every run processes again the objects that failed before."
    )


class ScheduleOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from a `Schedule` row

    name: str
    cron: str
    model: str
    source: dict[str, Any]
    output: str | None
    options: dict[str, Any] = Field(default_factory=dict)
    retry_failed: bool = False
    next_run_at: datetime
    last_job_id: str | None


class CountsOut(BaseModel):
    total: int = Field(
        description="What the run must do: the job's items (a bulk run's listing adds to it "
        "while `listing`; a video's frames add to it as it is expanded)."
    )
    done: int = Field(
        0,
        description="Progress over `total`, never more: the items that ended (succeeded, "
        "failed, cancelled) and those answered whose chunk has not written them yet.",
    )
    succeeded: int
    failed: int
    pending: int = Field(description="Items no worker holds yet.")
    running: int = Field(0, description="Items a worker holds now: being read or in a batch.")
    answered: int = Field(
        0, description="Of the running items, those answered whose chunk has not written them yet."
    )
    cancelled: int
    skipped: int = Field(
        0,
        description="A pipeline's rerun: objects unchanged since its last run, left alone. Not "
        "items: in neither `total` nor `done`.",
    )
    deleted: int = Field(
        0,
        description="A pipeline's rerun: objects gone since its last run. Not items: in neither "
        "`total` nor `done`.",
    )
    known_failed: int = Field(
        0,
        description="Pipeline runs: unchanged objects whose input failed with this model version "
        "in an earlier run, kept as they are (`retry_failed` runs them again).",
    )
    excluded: int = Field(0, description="Bulk jobs: objects listed that the filters left out.")
    fell_back: int = Field(0, description="Items the job's fallback model took.")
    fell_back_succeeded: int = Field(0, description="Of those, the items it answered.")
    expanding: int | None = Field(
        0,
        description="Of the items not ended, videos (by name: .mp4, .mov, …) no worker has "
        "expanded into their sampled frames yet; `total` grows by their frames when one does. "
        "Null: not counted (over 10,000 items not ended).",
    )


class JobOut(BaseModel):
    id: str
    model: str
    status: str
    counts: CountsOut
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    items_per_second: float | None = Field(
        description="Open: items worked per second over the last minute (each chunk run's "
        "items spread over the run, written or answered); closed: the run's."
    )
    eta_seconds: float | None = None
    stalled_since: datetime | None = Field(
        None,
        description="Some items are held by a worker that stopped renewing them (it died or "
        "hangs) since then; they go to another worker when their lease runs out and the "
        "reconciler (kiln beat) re-sends them.",
    )
    waiting_for_worker: bool = Field(
        False,
        description="Items wait, none runs, and no worker has reported in the last 30 s: "
        "the job waits until one starts (`kiln worker`).",
    )
    listing: bool = False
    source: dict[str, Any] | None = None
    pipeline: str | None = Field(None, description="The incremental pipeline it is a run of.")
    schedule: str | None = Field(None, description="The schedule that started it.")
    output: str | None = Field(
        None,
        description="The s3:// prefix its results are written under (in `<output>/<id>/`); "
        "null: Kiln's own store (`results_url`).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="The options it runs with (its fallback pinned to an exact version).",
    )
    results_url: str
    error: str | None = None
    retry_of: str | None = Field(
        default=None, description="The job whose failed items this one replays."
    )
    retries: list[str] = Field(
        default_factory=list, description="The jobs that replay this one's failed items."
    )
    expires_at: datetime | None = Field(
        default=None, description="When retention deletes its items and results (null: kept)."
    )
    expired_at: datetime | None = Field(
        default=None, description="When they were deleted; `counts` is then the summary kept."
    )
    notify: NotifyOut | None = None


class SignedUrlOut(BaseModel):
    key: str = Field(description="The object's key in the results store.")
    url: str = Field(description="A presigned GET URL: no API key needed until it expires.")


class ResultUrlsOut(BaseModel):
    job_id: str
    status: str
    expires_at: datetime
    manifest: SignedUrlOut | None = Field(description="None until the job has ended.")
    shards: list[SignedUrlOut]


class JobsPage(BaseModel):
    jobs: list[JobOut]
    next: str | None


class ItemOut(BaseModel):
    key: str
    status: str
    error: str | None = Field(
        description="Why it failed; on a pending item, what stopped its last run."
    )
    attempts: int = Field(description="Runs that took it (at most KILN_MAX_ATTEMPTS).")
    duration_ms: float | None
    outputs: dict[str, Any] | None
    answered_by: str | None = Field(None, description="The model ref whose outputs these are.")
    fallback_reason: str | None = Field(
        None, description="Why the job's model did not answer, when its fallback took the item."
    )
    frame_index: int | None = Field(None, description="A video frame's index in its video.")
    frame_time_s: float | None = Field(
        None, description="The moment of its video a frame stands for, in seconds."
    )


class ItemsPage(BaseModel):
    items: list[ItemOut]
    next: str | None


class SearchIn(BaseModel):
    """A search as JSON: a `text` (text embedders) or the `key` of an item of the job. An image
    is sent as multipart/form-data instead (`file`, and `k` as a field)."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, min_length=1, max_length=100_000)
    key: str | None = Field(None, min_length=1, max_length=1024)
    k: int = Field(10, description="How many items to answer, 1 to 100.")


class HitOut(BaseModel):
    key: str
    similarity: float = Field(description="Cosine similarity to the query, -1 to 1.")
    thumbnail_url: str | None = Field(None, description="A JPEG preview (image jobs).")


class SearchOut(BaseModel):
    job_id: str = Field(
        description="The job searched; for a pipeline, its newest closed run, whose model "
        "version's library was searched."
    )
    model: str = Field(description="The exact model version whose vectors were compared.")
    pipeline: str | None = Field(None, description="The pipeline searched, if one was.")
    query: Literal["image", "text", "key"]
    query_job_id: str | None = Field(
        None, description="The one-item job that embedded an image or text query."
    )
    hits: list[HitOut] = Field(description="Most alike first.")


class RunCountsOut(BaseModel):
    total: int = Field(description="Items the run had to process: new and changed objects.")
    succeeded: int
    failed: int
    cancelled: int
    pending: int = Field(description="Items not finished yet.")
    skipped: int = Field(description="Objects unchanged since an earlier run.")
    deleted: int = Field(description="Objects gone from the source since the run before.")
    known_failed: int = Field(
        0, description="Objects unchanged since they failed with this model version: kept."
    )
    excluded: int = Field(0, description="Objects listed that the source's filters left out.")


class PipelineRunOut(BaseModel):
    id: str
    model: str = Field(description="The exact model version the run ran.")
    status: str
    created_at: datetime
    finished_at: datetime | None
    error: str | None = None
    counts: RunCountsOut


class PipelineObjectsOut(BaseModel):
    """The objects the pipeline's last listing found in its source."""

    live: int
    succeeded: int = Field(description="Their current content has a result.")
    failed: int = Field(
        description="Known failures: their newest result, of their current content, failed."
    )
    pending: int = Field(
        description="No result of their current content yet: new or changed since the last "
        "run, or a run has not reached them."
    )


class FailureOut(BaseModel):
    key: str
    error: str | None
    job_id: str = Field(description="The run whose item failed.")


class PipelineOut(BaseModel):
    name: str
    model: str = Field(description="As named: a name alone follows the latest version.")
    source: dict[str, Any]
    output: str | None
    created_at: datetime
    run_count: int
    last_run: PipelineRunOut | None
    schedule: ScheduleOut | None = Field(None, description="The schedule that runs it, if any.")
    objects: PipelineObjectsOut
    results_url: str = Field(description="Its current results: one row per live object.")


class PipelineDetailOut(PipelineOut):
    runs: list[PipelineRunOut] = Field(description="Newest first, at most `runs` of them.")
    failures: list[FailureOut] = Field(
        description="Known failures by key, at most 100 (`objects.failed` counts them all)."
    )


class EngineOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from an `EngineReport` row

    node: str = Field(description="The worker (Celery node) that loaded the model.")
    backend: str = Field(examples=["tensorrt:fp16", "onnxruntime:CPUExecutionProvider"])
    reason: str
    device: str
    updated_at: datetime


class ModelOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read from a `ModelInfo`

    name: str
    ref: str = Field(description="What a job records: NAME, or NAME:VERSION when registered.")
    kind: str
    input: str
    description: str
    builtin: bool
    version: str
    versions: list[int] = Field(default_factory=list, description="Registered versions.")
    sha256: str | None = None
    spec: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime | None = None
    engines: list[EngineOut] = Field(
        default_factory=list, description="Backends workers run it on, as they reported."
    )


_FIT = (
    "crop: resize the short side to input_size ÷ crop_ratio, keep the centre; "
    "squash: resize to the square; letterbox: fit the long side, pad right and bottom."
)


class ModelSpecIn(BaseModel):
    """A registered image model's spec; fields left out take the family's defaults (detect:
    letterbox, mean 0 and std 1; classify and embed: crop, ImageNet's mean and std)."""

    model_config = ConfigDict(extra="forbid")

    input_size: int = Field(..., ge=8, le=4096, description="Square input side, pixels.")
    labels: list[str] = Field(default_factory=list, max_length=100_000)
    mean: tuple[float, float, float] | None = Field(
        None, description="Per channel, in the model's channel order and pixel range."
    )
    std: tuple[float, float, float] | None = None
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    top_k: int = Field(5, ge=1, le=1000)
    max_batch: int | None = Field(None, ge=1, le=4096)
    fp16: bool = False
    description: str = Field("", max_length=1000)
    fit: Literal["crop", "squash", "letterbox"] | None = Field(None, description=_FIT)
    resize_filter: Literal["bilinear", "bicubic", "lanczos", "nearest"] = "bilinear"
    crop_ratio: float = Field(0.875, gt=0, le=1)
    channel_order: Literal["RGB", "BGR"] = "RGB"
    pixel_range: Literal["0-1", "0-255"] = "0-1"
    score_threshold: float | None = Field(None, ge=0, le=1, description="detect only")
    iou_threshold: float | None = Field(None, ge=0, le=1, description="detect only")
    max_boxes: int | None = Field(None, ge=1, le=10_000, description="detect only")
    refuse_below: Number | None = Field(
        None,
        description="classify only: a top score below it (0 to 1) is a refusal, which a job's "
        "fallback model may answer; otherwise the item fails.",
    )


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=128, examples=["resnet50-products"])
    kind: Literal["classify", "embed", "detect"]
    source: str = Field(..., max_length=2048, examples=["s3://models/resnet50.onnx"])
    spec: ModelSpecIn


class ErrorOut(BaseModel):
    detail: str


MALFORMED_BODY: dict[str, Any] = {
    "model": ErrorOut,
    "description": "A body Kiln cannot parse: not UTF-8, or a multipart form with too many "
    "files or fields.",
}
