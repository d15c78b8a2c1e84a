"""What a Batcher moves: blocks of rows, the `Part`s of them a batch is cut from, and the
`Shape` that cuts a batch's result back into parts and joins them into a block's answer.

A caller's block becomes a `Queued` (its future, and how many of its rows are cut and
answered); a runner's batch is a list of `Taken` (rows [start, stop) of a queued block), given
to the batch function as `Part`s. No row ever needs a future or an object of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence, Sized
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from opentelemetry.trace import SpanContext

from kiln.app.observability.tracing import current_span_context

B = TypeVar("B", bound=Sized)  # a block of rows
R = TypeVar("R", bound=Sized)  # what the batch function answers for its rows (one per row)


class Shape(Protocol[R]):
    """How a batcher's results are cut into parts, joined into a block's, and made for rows
    that failed (an error that is not transient fails its rows, not the block)."""

    def cut(self, result: R, start: int, stop: int) -> R: ...

    def join(self, parts: Sequence[R]) -> R: ...

    def failed(self, rows: int, error: Exception) -> R: ...


class ListShape:
    """Results as one list entry per row; a failed row holds its exception."""

    def cut(self, result: list[Any], start: int, stop: int) -> list[Any]:
        return result[start:stop]

    def join(self, parts: Sequence[list[Any]]) -> list[Any]:
        return [row for part in parts for row in part]

    def failed(self, rows: int, error: Exception) -> list[Any]:
        return [error] * rows


@dataclass(frozen=True)
class Part(Generic[B]):
    """Rows [start, stop) of a block: what batches are made of."""

    block: B
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


BatchFn = Callable[[Sequence[Part[B]]], R]


class Queued(Generic[B, R]):
    """A submitted block: its rows not yet cut into a batch, and its parts' results."""

    def __init__(self, block: B, urgent: bool) -> None:
        self.block = block
        self.rows = len(block)
        self.urgent = urgent
        self.future: Future[R] = Future()
        self.cut = 0  # rows already taken into batches
        self.remaining = self.rows  # rows without a result yet
        self.parts: dict[int, R] = {}  # by start row
        self.enqueued = time.monotonic()
        self.origin: SpanContext = current_span_context()  # the submitter's span
        self.lock = threading.Lock()


@dataclass
class Taken(Generic[B, R]):
    """Rows [start, stop) of a queued block, taken into a batch."""

    queued: Queued[B, R]
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


def answer(taken: Taken[B, R], result: R, shape: Shape[R]) -> None:
    """Record the result of a block's taken rows; the last of its parts settles its future
    with them all, joined in row order."""
    queued = taken.queued
    with queued.lock:
        queued.parts[taken.start] = result
        queued.remaining -= len(taken)
        if queued.remaining:
            return
        parts = [queued.parts[start] for start in sorted(queued.parts)]
    settle(queued.future, result=shape.join(parts))


def settle(future: Future[Any], result: object = None, error: BaseException | None = None) -> None:
    """Resolve a block's future unless it is settled already (the watchdog failed it, or a
    transient failure of one of its parts did)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # expired past its deadline: the caller already has its error
