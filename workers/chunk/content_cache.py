"""Results remembered by model version and input bytes, so the same input never runs twice.

Small outputs are kept as JSON; a vector output (an embedding) as raw bytes beside them, since
JSON would triple its size and lose float32 exactness.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.workers.models.base import VECTOR_OUTPUTS

Entry = tuple[dict[str, Any], bytes | None, str | None]  # outputs, vector bytes, vector dtype


def encode(outputs: Mapping[str, Any]) -> Entry:
    """Outputs → what the cache stores: JSON-able outputs, and the vector as raw bytes."""
    small = {k: v for k, v in outputs.items() if k not in VECTOR_OUTPUTS}
    vectors = [np.asarray(outputs[k]) for k in VECTOR_OUTPUTS if outputs.get(k) is not None]
    if not vectors:
        return small, None, None
    (vector,) = vectors  # one vector output per model family
    little = vector.astype(vector.dtype.newbyteorder("<"), copy=False)
    return small, little.tobytes(), str(vector.dtype)


def decode(outputs: Mapping[str, Any], vector: bytes | None, dtype: str | None) -> dict[str, Any]:
    restored = dict(outputs)
    if vector is not None and dtype is not None:
        (name,) = VECTOR_OUTPUTS
        restored[name] = np.frombuffer(vector, dtype=np.dtype(dtype).newbyteorder("<")).copy()
    return restored
