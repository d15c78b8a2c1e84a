"""Dispatchers that send nothing: one that records what it was asked, one whose broker is down.

Tests of the submit path use them in place of the broker (as dramatiq's `StubBroker`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Enqueued:
    job_id: str
    chunk: int
    item_ids: list[int]
    queue: str


@dataclass(frozen=True)
class IngestStep:
    job_id: str
    owner: str | None
    countdown: float


@dataclass
class RecordingDispatcher:
    """A `Dispatcher` that only remembers what it was asked to send."""

    calls: list[Enqueued] = field(default_factory=list)
    ingests: list[IngestStep] = field(default_factory=list)

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        self.calls.append(Enqueued(job_id, chunk, list(item_ids), queue))

    def enqueue_ingest(self, job_id: str, owner: str | None = None, countdown: float = 0) -> None:
        self.ingests.append(IngestStep(job_id, owner, countdown))


class BrokenDispatcher:
    """A `Dispatcher` whose broker is down."""

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        raise ConnectionError("Connection refused")

    def enqueue_ingest(self, job_id: str, owner: str | None = None, countdown: float = 0) -> None:
        raise ConnectionError("Connection refused")
