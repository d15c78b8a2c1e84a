"""What every model family provides to the chunk processor and the Batcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# Outputs too large for a database row (DESIGN.md: embeddings go to storage, not rows): they
# reach the Parquet shard and the content cache, and are left out of `items.outputs`.
VECTOR_OUTPUTS = frozenset({"embedding"})


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
        """Turn one raw result into the item's outputs."""

    def close(self) -> None:
        """Release what the pipeline holds beyond its engine (inner Batchers, threads)."""
