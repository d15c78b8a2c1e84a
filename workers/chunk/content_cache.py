"""Results remembered by tenant, model version and input bytes, so the same input never runs
twice for the same tenant (or for anyone, when `KILN_CONTENT_CACHE_SHARED` is set).

Small outputs are kept as JSON; a vector output (an embedding) as raw bytes beside them, since
JSON would triple its size and lose float32 exactness. The rows: kiln.app.db.content_cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.workers.chunk.rows import ChunkRows, Piece
from kiln.workers.models.base import VECTOR_OUTPUTS

Entry = tuple[dict[str, Any], bytes | None, str | None]  # outputs, vector bytes, vector dtype


def scope_key(settings: Settings, tenant: str, model: ModelInfo) -> str:
    """The cache key of `model`'s results for `tenant`: the only place a scope is chosen.

    Per tenant unless the operator shares the cache: a hit answers visibly faster, so a shared
    cache tells one tenant that another already processed the same bytes. Tenant names have no
    "/" (kiln.app.tenants.auth), so no tenant's scope can look like another's or like "shared".
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


def hits_piece(
    rows: np.ndarray, entries: Sequence[Entry], fields: Sequence[pa.Field], model: ModelInfo
) -> Piece:
    """Rows the cache answered, as a piece of the chunk's results."""
    return Piece.of_outputs(rows, [decode(*entry) for entry in entries], fields, model)


def fresh_entries(settings: Settings, tenant: str, rows: ChunkRows) -> dict[str, dict[str, Entry]]:
    """What this run computed, for the cache: by the scope of the model that answered each
    row (a job's model's entries never hold its fallback's answers), then by input sha256.
    The rows' small outputs are the ones the database gets (`ChunkRows.answers`, read once);
    a piece with no vector column takes them as they are, with no work per row."""
    fresh: dict[str, dict[str, Entry]] = {}
    answers, sha256 = rows.answers(), rows.sha256
    for piece in rows.pieces:
        if piece.outputs is not None:  # answered by the cache itself
            continue
        scope = fresh.setdefault(scope_key(settings, tenant, piece.model), {})
        indices = piece.rows.tolist()
        vectors = {k: c for k, c in piece.columns.items() if k in VECTOR_OUTPUTS}
        if not vectors:
            scope.update(
                (digest, (answers[row] or {}, None, None))
                for row in indices
                if (digest := sha256[row]) is not None
            )
            continue
        for i, row in enumerate(indices):
            digest = sha256[row]
            if digest is None:
                continue
            whole = (answers[row] or {}) | {
                k: c[i].values.to_numpy(zero_copy_only=False) for k, c in vectors.items()
            }
            scope[digest] = encode(whole)
    return {k: v for k, v in fresh.items() if v}
