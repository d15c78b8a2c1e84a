"""A chunk's rows as columns: pieces joined into the shard's columns and the database's
outputs, whatever order they answered in and whatever types they came in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import get_settings
from kiln.app.db.leases import LeasedItem
from kiln.workers.chunk.content_cache import fresh_entries
from kiln.workers.chunk.rows import ChunkRows, Piece
from kiln.workers.models.classify import FIELDS

MODEL = ModelInfo("m", "classify", "image", "", builtin=True, version="1")
RAW = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float64())]))


def _rows(n: int) -> ChunkRows:
    return ChunkRows([LeasedItem(i, "job", f"k{i}", f"store:{i}", None, 0, 1) for i in range(n)])


def _labels(rows: list[int]) -> pa.Array:
    """A block's column as a model answers it (scores in float64, not the shard's type)."""
    return pa.array([[{"label": f"l{r}", "score": r / 10}] for r in rows], RAW)


def _piece(rows: list[int]) -> Piece:
    return Piece(np.asarray(rows), {"labels": _labels(rows)}, MODEL)


def test_blocks_answered_out_of_order_land_on_their_rows() -> None:
    rows = _rows(6)
    for block in ([4, 5], [0, 1], [3]):
        rows.answer(_piece(block))
    rows.fail(2, "bad input")
    column = rows.table(FIELDS).column("labels")
    assert column.type == FIELDS[0].type
    labels = [None if v is None else v[0]["label"] for v in column.to_pylist()]
    assert labels == ["l0", "l1", None, "l3", "l4", "l5"]
    outputs = rows.outputs()
    assert outputs[2] is None
    assert [o["labels"][0]["label"] for o in outputs if o is not None] == [
        "l0", "l1", "l3", "l4", "l5",
    ]  # fmt: skip


def test_blocks_in_order_keep_the_order_and_nulls_trail() -> None:
    rows = _rows(5)
    rows.answer(_piece([0, 1]))
    rows.answer(_piece([2, 3]))
    column = rows.table(FIELDS).column("labels").to_pylist()
    assert [v[0]["label"] for v in column[:4]] == ["l0", "l1", "l2", "l3"]
    assert column[4] is None


def test_stored_outputs_beside_computed_blocks() -> None:
    """A content cache hit (outputs as stored, columns in the shard's types) among a model's
    blocks (its own types): each row's outputs and column value are its own."""
    rows = _rows(4)
    rows.answer(_piece([0]))
    stored = [{"labels": [{"label": "cached", "score": 0.5}]}]
    rows.answer(Piece.of_outputs(np.asarray([1]), stored, FIELDS, MODEL))
    rows.answer(_piece([2, 3]))
    column = rows.table(FIELDS).column("labels").to_pylist()
    assert [v[0]["label"] for v in column] == ["l0", "cached", "l2", "l3"]
    outputs = rows.outputs()
    assert outputs[1] == stored[0]
    assert [o["labels"][0]["score"] for o in outputs if o] == [0.0, 0.5, 0.2, 0.3]


def test_a_block_without_the_column_is_null_there() -> None:
    rows = _rows(3)
    rows.answer(_piece([0]))
    rows.answer(Piece(np.asarray([1, 2]), {}, MODEL))
    column = rows.table(FIELDS).column("labels").to_pylist()
    assert column[0] is not None and column[1:] == [None, None]
    assert rows.outputs()[1:] == [{}, {}]


def test_the_cache_entries_are_the_rows_answers_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fresh_entries takes each answered row's outputs as the database gets them, by digest
    (a row with none is left out, a cache hit too), from one read of the pieces."""
    settings = get_settings(data_dir=tmp_path)
    rows = _rows(5)
    rows.sha256 = ["d0", "d1", None, "d3", "d4"]
    for block in ([3, 4], [0, 2]):
        rows.answer(_piece(block))
    hit = {"labels": [{"label": "known", "score": 1.0}]}
    rows.answer(Piece(np.asarray([1]), {"labels": _labels([1])}, MODEL, outputs=[hit]))
    reads: list[Piece] = []
    real = Piece.small_outputs

    def read(piece: Piece) -> list[dict[str, Any]]:
        reads.append(piece)
        return real(piece)

    monkeypatch.setattr(Piece, "small_outputs", read)

    fresh = fresh_entries(settings, "acme", rows)
    outputs = rows.document(stages=False)

    (entries,) = fresh.values()
    assert entries == {
        "d0": ({"labels": [{"label": "l0", "score": 0.0}]}, None, None),
        "d3": ({"labels": [{"label": "l3", "score": 0.3}]}, None, None),
        "d4": ({"labels": [{"label": "l4", "score": 0.4}]}, None, None),
    }
    assert [row[3] for row in outputs][:2] == [entries["d0"][0], hit]
    assert len(reads) == 2  # the computed pieces joined in one read, the hit's; none again


def test_a_copy_without_some_rows_keeps_every_column() -> None:
    """`without` (a chunk's videos leaving as frames) cuts every column in `COLUMNS` to the
    rows kept and renumbers the pieces: each column is filled with values that say their row,
    so a column dropped or misaligned shows."""
    rows = _rows(5)
    for name in ChunkRows.COLUMNS:
        column = getattr(rows, name)
        if isinstance(column, np.ndarray):
            column[...] = np.arange(5).reshape((5,) + (1,) * (column.ndim - 1)) % 2
        else:
            column[:] = [f"{name}{i}" for i in range(5)]
    rows.answer(_piece([2, 4]))

    kept = rows.without([1, 3])

    assert [item.key for item in kept.items] == ["k0", "k2", "k4"]
    for name in ChunkRows.COLUMNS:
        assert np.array_equal(
            np.asarray(getattr(kept, name)), np.asarray(getattr(rows, name))[[0, 2, 4]]
        ), name
    assert [p.rows.tolist() for p in kept.pieces] == [[1, 2]]


def test_every_per_row_column_is_named_in_columns() -> None:
    """A column set on the rows but not named in `COLUMNS` would be lost by a copy."""
    rows = _rows(3)
    per_row = {
        name
        for name, value in vars(rows).items()
        if name not in {"items", "pieces", "_answers"} and hasattr(value, "__len__")
    }
    assert per_row == set(ChunkRows.COLUMNS)
    with pytest.raises(TypeError, match="no column"):
        ChunkRows([], colour=[])
