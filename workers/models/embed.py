"""Any registered ONNX image embedder: its declared preprocessing, one unit-length vector per
image."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Answers, Batch, null_mask, numeric, row_errors
from kiln.workers.models.image_model import ImageModelPredictor


def fields(spec: dict[str, Any]) -> list[pa.Field]:
    """Parquet columns, named like `finish`'s keys: the vector, and its length in `dim`.

    A list, not a fixed-size list: a failed item's vector is null, and pyarrow (25) cannot read
    back a Parquet fixed-size list column holding a null ("Expected all lists to be of size=N"),
    so one failed item made the whole job's results unreadable."""
    item = pa.float16() if spec.get("fp16") else pa.float32()
    return [pa.field("embedding", pa.list_(item)), pa.field("dim", pa.int32())]


def require_finite(vector: np.ndarray) -> None:
    """A vector with NaN or infinity cannot be compared or searched: the item fails."""
    if not np.isfinite(vector).all():
        raise InputError(NOT_FINITE)


NOT_FINITE = "The model returned NaN or infinity for this input; no vector kept."


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, in float32; an all-zero row stays zero (no NaN)."""
    wide = vectors.astype(np.float64)  # float16 outputs and huge values square without overflow
    norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))[:, None]
    return (wide / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def vector_answers(
    vectors: np.ndarray, failed: dict[int, Exception], extra: dict[str, pa.Array]
) -> Answers:
    """Vectors as the `embedding` column (null where a row failed or is not finite), beside
    the family's other columns."""
    rows = len(vectors)
    bad = ~np.isfinite(vectors).all(axis=1)
    failed = {int(i): InputError(NOT_FINITE) for i in bad.nonzero()[0]} | failed
    mask = np.zeros(rows, dtype=bool)
    mask[list(failed)] = True
    width = vectors.shape[1]
    offsets = numeric(np.arange(0, rows * width + 1, width), pa.int32())
    embedding = pa.ListArray.from_arrays(offsets, numeric(vectors), mask=null_mask(mask))
    columns = {"embedding": embedding, **extra}
    if not failed:
        return Answers(rows, columns)
    errors, refused = row_errors(rows, failed)
    return Answers(rows, columns, errors, refused)


class EmbedPredictor(ImageModelPredictor):
    kind = "embed"

    def __init__(
        self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int, **kw: Any
    ) -> None:
        super().__init__(name, engine, spec, max_pixels=max_pixels, **kw)
        self.dim = int(spec["dim"])
        self.dtype = np.float16 if spec.get("fp16") else np.float32
        self._check_output()

    def _check_output(self) -> None:
        width = self.engine.outputs[0].shape[-1] if self.engine.outputs else None
        if isinstance(width, int) and width != self.dim:
            raise ValueError(
                f"Model {self.name!r} outputs {width} values per image, but was registered "
                f"with dim {self.dim}."
            )

    def infer(self, batch: Batch) -> Answers:
        vectors, failed = self._run(batch)
        if vectors.shape[1] != self.dim:
            raise ValueError(
                f"Model {self.name!r} returned {vectors.shape[1]} values, not {self.dim}."
            )
        dims = numeric(np.full(len(batch), self.dim, dtype=np.int32))
        return vector_answers(l2_normalize(vectors).astype(self.dtype), failed, {"dim": dims})
