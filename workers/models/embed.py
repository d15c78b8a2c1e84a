"""Any registered ONNX image embedder: centre crop, mean/std, one unit-length vector per image."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Prepared
from kiln.workers.models.image_model import ImageModelPipeline


def fields(spec: dict[str, Any]) -> list[pa.Field]:
    """Parquet columns, named like `finish`'s keys: the vector as a fixed-size list."""
    item = pa.float16() if spec.get("fp16") else pa.float32()
    return [pa.field("embedding", pa.list_(item, int(spec["dim"]))), pa.field("dim", pa.int32())]


def l2_normalize(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, in float32; an all-zero row stays zero (no NaN)."""
    wide = vectors.astype(np.float64)  # float16 outputs and huge values square without overflow
    norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))[:, None]
    return (wide / np.where(norms > 0, norms, 1.0)).astype(np.float32)


class EmbedPipeline(ImageModelPipeline):
    def __init__(self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int):
        super().__init__(name, engine, spec, max_pixels=max_pixels)
        self.layout = str(spec.get("layout", "NCHW"))
        self.dim = int(spec["dim"])
        self.dtype = np.float16 if spec.get("fp16") else np.float32
        # A model that takes half-precision input gets it straight from `normalize`.
        self.input_dtype = "float16" if engine.inputs[0].dtype == "float16" else "float32"
        self._check_output()

    def _check_output(self) -> None:
        width = self.engine.outputs[0].shape[-1] if self.engine.outputs else None
        if isinstance(width, int) and width != self.dim:
            raise ValueError(
                f"Model {self.name!r} outputs {width} values per image, but was registered "
                f"with dim {self.dim}."
            )

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        vectors = self._run(rows)
        if vectors.shape[1] != self.dim:
            raise ValueError(
                f"Model {self.name!r} returned {vectors.shape[1]} values, not {self.dim}."
            )
        return list(l2_normalize(vectors).astype(self.dtype))

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        return {"embedding": raw, "dim": self.dim}
