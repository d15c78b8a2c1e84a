"""The content cache's encoding: small outputs as JSON, a vector as exact raw bytes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.workers.chunk.content_cache import decode, encode


def test_outputs_without_a_vector_are_plain_json() -> None:
    outputs = {"labels": [{"label": "cat", "score": 0.9}]}
    small, vector, dtype = encode(outputs)
    assert (small, vector, dtype) == (outputs, None, None)
    assert decode(json.loads(json.dumps(small)), vector, dtype) == outputs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_vector_round_trips_exactly(dtype: type) -> None:
    vector = np.random.default_rng(0).standard_normal(384).astype(dtype)
    small, raw, stored = encode({"embedding": vector, "tokens": 7})
    assert small == {"tokens": 7} and stored == np.dtype(dtype).name
    assert raw is not None and len(raw) == vector.nbytes
    restored = decode(small, raw, stored)
    assert restored["tokens"] == 7
    assert restored["embedding"].dtype == vector.dtype
    np.testing.assert_array_equal(restored["embedding"], vector)
