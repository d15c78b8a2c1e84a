"""A chunk's rows as columns: pieces joined into the shard's columns and the database's
outputs, whatever order they answered in and whatever types they came in."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kiln.app.catalog import ModelInfo
from kiln.app.db.leases import LeasedItem
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
