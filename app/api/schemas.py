"""The API's request and response bodies."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class InputIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str | None = Field(None, max_length=2048, examples=["s3://bucket/photos/cat.jpg"])
    text: str | None = Field(None, max_length=100_000)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., min_length=1, max_length=128)
    inputs: list[InputIn] = Field(..., min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)


class CountsOut(BaseModel):
    total: int
    succeeded: int
    failed: int
    pending: int
    cancelled: int


class JobOut(BaseModel):
    id: str
    model: str
    status: str
    counts: CountsOut
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    items_per_second: float | None
    results_url: str
    error: str | None = None


class JobsPage(BaseModel):
    jobs: list[JobOut]
    next: str | None


class ItemOut(BaseModel):
    key: str
    status: str
    error: str | None
    attempts: int
    duration_ms: float | None
    outputs: dict[str, Any] | None


class ItemsPage(BaseModel):
    items: list[ItemOut]
    next: str | None


class ModelOut(BaseModel):
    name: str
    kind: str
    input: str
    description: str
    builtin: bool


class ErrorOut(BaseModel):
    detail: str
