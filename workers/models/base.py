"""What every model family provides to the chunk processor and the Batcher."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kiln.app.core.errors import InputError
from kiln.app.db.models import Job
from kiln.app.results import Place
from kiln.workers.library import Library

# Outputs too large for a database row (embeddings go to storage, not rows): they
# reach the Parquet shard and the content cache, and are left out of `items.outputs`.
VECTOR_OUTPUTS = frozenset({"embedding"})


class Refusal(InputError):
    """The model answered "no answer" for this input (a classifier below its confidence floor):
    `finish` raises it with a sentence. The item fails with it, unless the job's fallback
    model takes refusals (`fallback.on`), which is why it is told apart from other failures."""


@dataclass
class Prepared:
    """One decoded input, ready to be stacked into a batch (`pixels` may be token ids)."""

    pixels: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)


class Pipeline(Protocol):
    """A model family: `prepare` and `finish` run on task threads, `infer` on the Batcher's.

    Inputs are bytes (an image) or `str` (a text item). `finish` returns JSON-able values,
    except those named in `VECTOR_OUTPUTS`: 1-D NumPy arrays (float32, or float16).
    """

    name: str
    backend: str
    max_batch: int
    max_runners: int  # runner threads that may call `infer` at once

    def prepare(self, data: bytes | str) -> Prepared:
        """Decode and resize one input; raise `InputError` with a sentence if it is bad."""

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        """Run one batch through the engine; one raw result per row."""

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        """Turn one raw result into the item's outputs; raise `Refusal` for "no answer"."""

    def close(self) -> None:
        """Release what the pipeline holds beyond its engine (inner Batchers, threads)."""


@dataclass(frozen=True)
class ClosedJob:
    """What a family's job-closed step sees once a job has closed, before its manifest is
    written: the job, its succeeded items' outputs, and where its results are stored."""

    job: Job
    outputs: Callable[[], Iterable[tuple[str, dict[str, Any]]]]  # (key, outputs), in order
    place: Place
    # A pipeline run's library, already holding this run's rows: groups cover all of it.
    library: Library | None = None


# A family's step when one of its jobs closes (phash: near-duplicate groups); what it returns
# is added to the job's manifest.
JobClosed = Callable[[ClosedJob], dict[str, Any]]
