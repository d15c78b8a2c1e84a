"""Results remembered by tenant, model version and input bytes, so the same input never runs
twice for the same tenant (or for anyone, when `KILN_CONTENT_CACHE_SHARED` is set).

Small outputs are kept as JSON; a vector output (an embedding) as raw bytes beside them, since
JSON would triple its size and lose float32 exactness. The rows: kiln.app.db.content_cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.app.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.workers.models.base import VECTOR_OUTPUTS

Entry = tuple[dict[str, Any], bytes | None, str | None]  # outputs, vector bytes, vector dtype


def scope_key(settings: Settings, tenant: str, model: ModelInfo) -> str:
    """The cache key of `model`'s results for `tenant`: the only place a scope is chosen.

    Per tenant unless the operator shares the cache: a hit answers visibly faster, so a shared
    cache tells one tenant that another already processed the same bytes. Tenant names have no
    "/" (kiln.app.auth), so no tenant's scope can look like another's or like "shared".
    """
    scope = "shared" if settings.content_cache_shared else f"t:{tenant}"
    return f"{scope}/{model.cache_key}"


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
