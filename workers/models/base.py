"""What every model family provides to the chunk processor and the Batcher."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError, KilnError
from kiln.app.db.models import Job
from kiln.app.results.results import Place
from kiln.workers.models.library import Library
from kiln.workers.prep.spec import PrepSpec

# Outputs too large for a database row (embeddings go to storage, not rows): they
# reach the Parquet shard and the content cache, and are left out of `items.outputs`.
VECTOR_OUTPUTS = frozenset({"embedding"})


class Refusal(InputError):
    """The model answered "no answer" for this input (a classifier below its confidence floor):
    `finish` raises it with a sentence. The item fails with it, unless the job's fallback
    model takes refusals (`fallback.on`), which is why it is told apart from other failures."""


@runtime_checkable
class Staged(Protocol):
    """A predictor whose batches go through overlapped stages (`device/image_stages.py`):
    `in_flight` batches keep every stage busy (0: it runs batches one after another)."""

    in_flight: int


@dataclass
class Rows:
    """A block of one model's prepared rows, as the prep processes left them: slot indices
    (slot families: the pixels are in the model's shared-memory slots), each row's fit
    metadata, or objects (families whose rows have no fixed shape: OCR pages, token ids,
    encoded images for a GPU decoder)."""

    slots: np.ndarray | None = None
    meta: np.ndarray | None = None  # (rows, meta_width) float32
    objects: list[Any] | None = None

    def __len__(self) -> int:
        if self.slots is not None:
            return len(self.slots)
        return len(self.objects or [])


@dataclass
class Batch:
    """What a predictor's `infer` gets: a batch's rows gathered from one or more blocks."""

    pixels: np.ndarray | None = None  # (rows, *slot shape), uint8: gathered from the slots
    meta: np.ndarray | None = None
    objects: list[Any] | None = None

    def __len__(self) -> int:
        if self.pixels is not None:
            return len(self.pixels)
        return len(self.objects or [])


def failure_sentence(error: Exception) -> str:
    """What an item that failed in the engine or its post-processing says."""
    if isinstance(error, KilnError):
        return str(error)
    return f"The model failed on this input: {error}."


@dataclass
class Answers:
    """Outputs of some rows as columns (one value per row; null where a row failed), the
    sentence of each failed row, and whether that failure was a refusal ("no answer", which a
    fallback model may take). `raw`: per-row values a family finishes on the chunk's thread."""

    rows: int
    columns: dict[str, pa.Array] = field(default_factory=dict)
    errors: list[str | None] | None = None
    refused: list[bool] | None = None
    raw: list[Any] | None = None

    def __len__(self) -> int:
        return self.rows

    def slice(self, start: int, stop: int) -> Answers:
        return Answers(
            stop - start,
            {name: column.slice(start, stop - start) for name, column in self.columns.items()},
            None if self.errors is None else self.errors[start:stop],
            None if self.refused is None else self.refused[start:stop],
            None if self.raw is None else self.raw[start:stop],
        )

    def error_list(self) -> list[str | None]:
        return self.errors if self.errors is not None else [None] * self.rows

    def refused_list(self) -> list[bool]:
        return self.refused if self.refused is not None else [False] * self.rows

    @staticmethod
    def failed(rows: int, error: Exception) -> Answers:
        refused = isinstance(error, Refusal)
        return Answers(rows, {}, [failure_sentence(error)] * rows, [refused] * rows)

    @staticmethod
    def join(parts: Sequence[Answers]) -> Answers:
        """Parts in order; a column some part lacks (it failed whole) is null there."""
        if len(parts) == 1:
            return parts[0]
        types = {name: col.type for part in parts for name, col in part.columns.items()}
        columns = {
            name: pa.concat_arrays([p.columns.get(name, pa.nulls(p.rows, kind)) for p in parts])
            for name, kind in types.items()
        }
        errors = any(p.errors is not None for p in parts)
        refused = any(p.refused is not None for p in parts)
        raw = any(p.raw is not None for p in parts)
        return Answers(
            sum(p.rows for p in parts),
            columns,
            [e for p in parts for e in p.error_list()] if errors else None,
            [r for p in parts for r in p.refused_list()] if refused else None,
            [v for p in parts for v in (p.raw or [None] * p.rows)] if raw else None,
        )


class AnswersShape:
    """The Batcher's `Shape` for predictors: Answers are cut, joined and failed as columns."""

    def cut(self, result: Answers, start: int, stop: int) -> Answers:
        return result.slice(start, stop)

    def join(self, parts: Sequence[Answers]) -> Answers:
        return Answers.join(parts) if parts else Answers(0)

    def failed(self, rows: int, error: Exception) -> Answers:
        return Answers.failed(rows, error)


def names_of(labels: Sequence[str], classes: np.ndarray) -> pa.Array:
    """Each class index's label (its number past the labels), as an Arrow string array built
    from its buffers in NumPy: no Python string per row, no `pa.array` and no Arrow `take`
    (either cost the engine process far more CPU a call in `kiln run` than alone: `numeric`)."""
    classes = np.asarray(classes, dtype=np.int64)
    seen = int(classes.max()) + 1 if len(classes) else 0
    lengths, starts, data = _label_bytes((*labels, *(str(i) for i in range(len(labels), seen))))
    picked = lengths[classes]
    offsets = np.concatenate([[0], np.cumsum(picked)]).astype(np.int32)
    # byte j of row i is byte (j - offsets[i]) of its label: one gather over all the bytes
    within = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], picked)
    chosen = data[np.repeat(starts[classes], picked) + within]
    return pa.StringArray.from_buffers(
        len(classes), pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(chosen))
    )


def numeric(values: np.ndarray, kind: pa.DataType | None = None) -> pa.Array:
    """A 1-D NumPy array of numbers as an Arrow array over the same bytes (in `kind`'s width
    when given). Built from its buffer: `pa.array(ndarray)` cost the engine process ~0.6 ms
    of CPU a call, measured in `kiln run` (not alone), most of a small batch's answers."""
    dtype = np.dtype(kind.to_pandas_dtype()) if kind is not None else values.dtype
    flat = np.ascontiguousarray(values, dtype=dtype).ravel()
    if dtype == np.bool_:  # Arrow packs booleans in bits: not NumPy's bytes
        return pa.array(flat, pa.bool_())
    return pa.Array.from_buffers(pa.from_numpy_dtype(dtype), len(flat), [None, pa.py_buffer(flat)])


@functools.lru_cache(maxsize=32)
def _label_bytes(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A model's labels as UTF-8: each one's length and start in one byte array (kept, as a
    model's batches all ask for the same labels)."""
    encoded = [name.encode() for name in names]
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return lengths, starts, np.frombuffer(b"".join(encoded), dtype=np.uint8)


def null_mask(failed: np.ndarray | None) -> pa.Array | None:
    """An Arrow null mask for a column, or None when no row is null (nothing to build)."""
    return None if failed is None or not failed.any() else pa.array(failed, pa.bool_())


def row_errors(rows: int, failed: dict[int, Exception]) -> tuple[list[str | None], list[bool]]:
    """Per-row sentences and refusal flags for the rows of a batch that failed."""
    errors: list[str | None] = [None] * rows
    refused = [False] * rows
    for i, error in failed.items():
        errors[i] = failure_sentence(error)
        refused[i] = isinstance(error, Refusal)
    return errors, refused


class Predictor(Protocol):
    """A model family's batch half, run in the engine-owning process. Its prep half (`prep`)
    runs in the prep processes; `infer` on the Batcher's runner threads, a batch at a time;
    `finish` on the chunk's thread once a block's answers are in (most families answer in
    `infer` and return them as they are).

    Output columns are Arrow arrays named as the family's Parquet fields; floats are rounded
    as the results show them (the shard's schema casts them to its own types). Vectors (named
    in `VECTOR_OUTPUTS`) stay out of the database's copy.
    """

    name: str
    backend: str
    max_batch: int
    max_runners: int  # runner threads that may call `infer` at once
    prep: PrepSpec

    def infer(self, batch: Batch) -> Answers:
        """One batch through the engine and its post-processing."""
        ...

    def finish(self, answers: Answers) -> Answers:
        """What is left to do per row on the chunk's thread (OCR reads its lines here)."""
        ...

    def close(self) -> None:
        """Release what the predictor holds beyond its engine (inner Batchers, threads)."""
        ...


@runtime_checkable
class StagedPixels(Protocol):
    """A predictor whose batches' pixels may be gathered straight into its engine's staging
    buffer (image models on an engine with `HostStaging`). The runner that gathers a batch
    from the slots asks it where, so the pixels are copied once on their way to the device."""

    def pixel_buffer(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """Where a batch of `shape` uint8 pixels may be gathered; None: anywhere."""
        ...


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
