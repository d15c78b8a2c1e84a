"""A chunk's items as columns while it runs, and what they became: the shard's table, the
database's document and the content cache's entries are all read from here, once per chunk.

Rows are the leased items in id order. Answers arrive as *pieces*: the rows a block (or the
content cache) answered and their output columns; a row no piece answered has null outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import ItemStatus
from kiln.app.families.fallback import Trigger
from kiln.app.results.results import BASE_FIELDS
from kiln.app.video import split_key
from kiln.workers.models.base import VECTOR_OUTPUTS

STAGES_MS = ("fetch", "decode", "engine", "post")  # an interactive item's `stages_ms`
CANCELLED = "The job was cancelled."


@dataclass
class Piece:
    """Rows some model (or the content cache) answered, and their output columns."""

    rows: np.ndarray  # row indices into the chunk
    columns: dict[str, pa.Array]
    model: ModelInfo
    outputs: list[dict[str, Any]] | None = None  # as stored (content cache hits), if known

    @staticmethod
    def of_outputs(
        rows: np.ndarray,
        outputs: Sequence[dict[str, Any]],
        fields: Sequence[pa.Field],
        model: ModelInfo,
    ) -> Piece:
        """Rows answered with outputs as stored (a content cache hit): columns in the family's
        types, and the outputs kept, so the database gets them back unchanged."""
        columns = {f.name: pa.array([o.get(f.name) for o in outputs], f.type) for f in fields}
        return Piece(rows, columns, model, outputs=list(outputs))

    def small_outputs(self) -> list[dict[str, Any]]:
        """Each row's outputs as the database keeps them: JSON values, vectors left out."""
        if self.outputs is not None:
            return [{k: v for k, v in o.items() if k not in VECTOR_OUTPUTS} for o in self.outputs]
        small = {k: v for k, v in self.columns.items() if k not in VECTOR_OUTPUTS}
        return pa.table(small).to_pylist() if small else [{} for _ in range(len(self.rows))]


def _nones(n: int) -> list[Any]:
    return [None] * n


def _flags(n: int) -> np.ndarray:
    return np.zeros(n, dtype=bool)


def _stage_seconds(n: int) -> np.ndarray:
    return np.zeros((n, len(STAGES_MS)), dtype=np.float64)


class ChunkRows:
    """The chunk's rows: inputs, what happened to each, and the answers' pieces.

    Every per-row column is named once, in `COLUMNS`, with what makes it empty for n rows:
    `__init__` makes each and `without` copies each, so a column added there cannot be left
    out of a copy (and one set anywhere else fails `tests/workers/chunk/test_rows.py`)."""

    COLUMNS: ClassVar[dict[str, Callable[[int], Any]]] = {
        "errors": _nones,
        "failure": _nones,  # why a fallback may take the row
        # A failure that says nothing of the input (its model would not load, its attempts ran
        # out): a pipeline's rerun tries it again rather than keeping it as a known failure.
        "blameless": _flags,
        "cancelled": _flags,
        "cached": _flags,
        "sha256": _nones,
        "answered_by": _nones,
        "fallback_reason": _nones,
        "seconds": _stage_seconds,  # per stage of STAGES_MS
        "videos": _nones,  # a row that turned out a video: its FramePlan
    }
    errors: list[str | None]
    failure: list[Trigger | None]
    blameless: np.ndarray
    cancelled: np.ndarray
    cached: np.ndarray
    sha256: list[str | None]
    answered_by: list[str | None]
    fallback_reason: list[str | None]
    seconds: np.ndarray
    videos: list[Any]

    def __init__(
        self, items: Sequence[LeasedItem], pieces: Sequence[Piece] = (), **columns: Any
    ) -> None:
        """`columns`: some of `COLUMNS` given (a copy's); the rest are made empty."""
        self.items = list(items)
        for name, empty in self.COLUMNS.items():
            setattr(self, name, columns.pop(name) if name in columns else empty(len(items)))
        if columns:
            raise TypeError(f"ChunkRows has no column {sorted(columns)}")
        self.pieces: list[Piece] = list(pieces)
        self._answers: list[dict[str, Any] | None] | None = None  # `answers()`, once read

    def __len__(self) -> int:
        return len(self.items)

    def without(self, dropped: Sequence[int]) -> ChunkRows:
        """These rows less `dropped` (videos, now frames of their own), which no piece
        answered: every column cut to the rows kept, the pieces renumbered."""
        keep = np.setdiff1d(np.arange(len(self)), np.asarray(dropped, dtype=np.int64))
        new_index = np.full(len(self), -1, dtype=np.int64)
        new_index[keep] = np.arange(len(keep))
        kept = keep.tolist()
        columns = {name: _rows_of(getattr(self, name), keep, kept) for name in self.COLUMNS}
        pieces = [Piece(new_index[p.rows], p.columns, p.model, p.outputs) for p in self.pieces]
        return ChunkRows([self.items[i] for i in kept], pieces, **columns)

    # --- what happened -------------------------------------------------------------------

    def fail(
        self, row: int, sentence: str, failure: Trigger | None = None, blameless: bool = False
    ) -> None:
        self.errors[row], self.failure[row] = sentence, failure
        self.blameless[row] = blameless

    def answer(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self._answers = None
        for row in piece.rows.tolist():
            self.answered_by[row] = piece.model.ref

    def open(self) -> np.ndarray:
        """Rows not failed, not cancelled and not answered yet: what a model should run."""
        done = self.cancelled | np.array([e is not None for e in self.errors], dtype=bool)
        done |= np.array([a is not None for a in self.answered_by], dtype=bool)
        done |= np.array([v is not None for v in self.videos], dtype=bool)
        return np.flatnonzero(~done)

    def statuses(self) -> list[str]:
        # The members read once, not an enum attribute lookup per row (~4× the list's time).
        gone, failed, done = ItemStatus.CANCELLED, ItemStatus.FAILED, ItemStatus.SUCCEEDED
        return [
            gone if cancelled else (failed if error is not None else done)
            for cancelled, error in zip(self.cancelled.tolist(), self.errors, strict=True)
        ]

    def input_failures(self) -> list[str]:
        """Keys of the rows that failed for their input's sake (not cancelled, not blameless):
        what a pipeline keeps as known failures."""
        return [
            item.key
            for item, error, cancelled, blameless in zip(
                self.items, self.errors, self.cancelled.tolist(), self.blameless.tolist(),
                strict=True,
            )
            if error is not None and not cancelled and not blameless
        ]  # fmt: skip

    def shown_errors(self) -> list[str | None]:
        return [
            CANCELLED if cancelled else error
            for cancelled, error in zip(self.cancelled.tolist(), self.errors, strict=True)
        ]

    def duration_ms(self) -> np.ndarray:
        """Each item's own time: its fetch and decode, its block's time in the engine (filling
        and running) and its post-processing — not the chunk's wall time."""
        return np.asarray(np.round(self.seconds.sum(axis=1) * 1000, 2))

    def stages_ms(self) -> list[dict[str, float]]:
        ms = np.round(self.seconds * 1000, 2).tolist()
        return [dict(zip(STAGES_MS, row, strict=True)) for row in ms]

    # --- what is written -----------------------------------------------------------------

    def answers(self) -> list[dict[str, Any] | None]:
        """Each row's small outputs as its piece answered them (None where none did): read out
        of Arrow once per chunk, for the database's copy and the content cache's both."""
        if self._answers is None:
            out: list[dict[str, Any] | None] = [None] * len(self)
            for rows, values in _small_outputs(self.pieces):
                for row, value in zip(rows.tolist(), values, strict=True):
                    out[row] = value
            self._answers = out
        return self._answers

    def outputs(self) -> list[dict[str, Any] | None]:
        """Each row's small outputs (the database's copy), None where it has none."""
        out = list(self.answers())
        failed = np.array([e is not None for e in self.errors], dtype=bool)
        for row in np.flatnonzero(failed | self.cancelled).tolist():
            out[row] = None
        return out

    def table(self, fields: Sequence[pa.Field]) -> pa.Table:
        """The shard: the base columns, then the family's, in the shard's types."""
        keys = pa.array([item.key for item in self.items], pa.string())
        base = [
            keys,
            pa.array(self.statuses(), pa.string()),
            pa.array(self.shown_errors(), pa.string()),
            pa.array(self.duration_ms(), pa.float32()),
            pa.array(self.sha256, pa.string()),
            pa.array(self.answered_by, pa.string()),
            pa.array(self.fallback_reason, pa.string()),
            *self._frame_columns(keys),
        ]
        family = [self._column(f) for f in fields]
        schema = pa.schema([*BASE_FIELDS, *fields])
        return pa.Table.from_arrays([*base, *family], schema=schema)

    def _frame_columns(self, keys: pa.Array) -> list[pa.Array]:
        """source, frame_index, frame_time_s: for a chunk of no video frames (most), the keys
        and nulls, with no pass over the rows."""
        times = [item.frame_time_s for item in self.items]
        if not any(t is not None for t in times):
            return [keys, pa.nulls(len(self), pa.int32()), pa.nulls(len(self), pa.float64())]
        return [
            pa.array([split_key(i.key, i.frame_time_s) for i in self.items], pa.string()),
            pa.array([item.frame_index for item in self.items], pa.int32()),
            pa.array(times, pa.float64()),
        ]

    def _column(self, field: pa.Field) -> pa.Array:
        """One output column over every row: the pieces' values, nulls elsewhere. The pieces
        are joined in the order of their first rows (blocks finish out of order), so a chunk
        all answered in blocks of consecutive rows needs no `take` to put them back."""
        answered = sorted((p for p in self.pieces if len(p.rows)), key=lambda p: int(p.rows[0]))
        taken = np.concatenate([p.rows for p in answered]) if answered else np.empty(0, int)
        rest = np.setdiff1d(np.arange(len(self)), taken)
        columns = [(p.columns.get(field.name), len(p.rows)) for p in answered]
        column = _joined([*columns, (None, len(rest))], field.type)
        order = np.concatenate([taken, rest]).astype(np.int64)
        if not len(order) or (order[1:] > order[:-1]).all():  # the pieces in row order
            return column
        return column.take(pa.array(np.argsort(order, kind="stable")))

    def document(self, stages: bool) -> list[tuple[Any, ...]]:
        """The database's rows, one tuple each, in `queries.RESULT_COLUMNS` order: key,
        status, error, outputs, duration_ms, sha256, answered_by, fallback_reason, stages_ms
        (interactive chunks only)."""
        staged = self.stages_ms() if stages else [None] * len(self)
        return list(
            zip(
                [item.key for item in self.items],
                self.statuses(),
                self.shown_errors(),
                self.outputs(),
                self.duration_ms().tolist(),
                self.sha256,
                self.answered_by,
                self.fallback_reason,
                staged,
                strict=True,
            )
        )


def _joined(columns: Sequence[tuple[pa.Array | None, int]], kind: pa.DataType) -> pa.Array:
    """Pieces' columns one after another (None: that many nulls), in `kind`: joined first and
    cast once when they share a type (as one model's blocks do), not cast per block."""
    kinds = {column.type for column, _rows in columns if column is not None}
    same = kinds.pop() if len(kinds) == 1 else kind
    arrays = [
        pa.nulls(rows, same) if column is None else _cast(column, same) for column, rows in columns
    ]
    return _cast(pa.concat_arrays(arrays), kind)


def _cast(column: pa.Array, kind: pa.DataType) -> pa.Array:
    return column if column.type == kind else column.cast(kind)


def _small_outputs(pieces: Sequence[Piece]) -> Iterator[tuple[np.ndarray, list[dict[str, Any]]]]:
    """Each piece's rows and their small outputs (`Piece.small_outputs`); a run of pieces with
    the same columns (one model's blocks) is read out of Arrow in one call, not one a block."""
    run: list[Piece] = []
    for piece in [*pieces, None]:
        if run and (piece is None or not _joinable(run[0], piece)):
            if len(run) == 1:
                yield run[0].rows, run[0].small_outputs()
            else:
                rows = np.concatenate([p.rows for p in run])
                yield rows, Piece(rows, _joined_columns(run), run[0].model).small_outputs()
            run = []
        if piece is not None:
            run.append(piece)


def _joinable(first: Piece, piece: Piece) -> bool:
    """Whether two pieces' columns can be read out together: computed (not outputs as stored),
    with the same names and types."""
    if first.outputs is not None or piece.outputs is not None:
        return False
    kinds = {name: column.type for name, column in first.columns.items()}
    return kinds == {name: column.type for name, column in piece.columns.items()}


def _joined_columns(pieces: Sequence[Piece]) -> dict[str, pa.Array]:
    return {name: pa.concat_arrays([p.columns[name] for p in pieces]) for name in pieces[0].columns}


def _rows_of(values: Any, keep: np.ndarray, kept: list[int]) -> Any:
    """A per-row column's rows `keep` (an array's by index, a list's one by one)."""
    return values[keep] if isinstance(values, np.ndarray) else [values[i] for i in kept]
