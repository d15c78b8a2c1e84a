"""Near-duplicate grouping shared by the families: components over close pairs, and cosine
pairs over embeddings (exact, in blocks)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kiln.app.core.errors import InputError
from kiln.app.results.vector_index import VectorIndex
from kiln.workers.models.grouping import (
    components,
    cosine_groups,
    cosine_pairs,
    groups_of,
    neighbour_pairs,
)


def test_components_join_transitively() -> None:
    assert components(5, [(0, 2), (2, 4)]) == [0, 1, 0, 3, 0]
    assert groups_of(list("abcde"), components(5, [(3, 1), (2, 4)])) == [["b", "d"], ["c", "e"]]
    assert components(0, []) == []


def brute_pairs(vectors: np.ndarray, threshold: float) -> set[tuple[int, int]]:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    return {
        (i, j)
        for i, j in itertools.combinations(range(len(vectors)), 2)
        if float(unit[i] @ unit[j]) >= threshold
    }


@pytest.mark.parametrize("block", [1, 7, 2048])
def test_blocked_pairs_are_every_pair_above_the_threshold(block: int) -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(size=(20, 16))
    vectors = np.concatenate([base, base[:6] + rng.normal(scale=0.05, size=(6, 16))])
    found = {tuple(p) for p in cosine_pairs(vectors, 0.9, block=block).tolist()}
    assert found == brute_pairs(vectors, 0.9)
    assert {(i, 20 + i) for i in range(6)} <= found  # each copy pairs with its original


def test_groups_carry_each_members_similarity_to_the_first() -> None:
    a = np.array([1.0, 0.0, 0.0])
    near = np.array([0.99, 0.1, 0.0])
    far = np.array([0.0, 1.0, 0.0])
    groups = cosine_groups(["a", "b", "c", "d"], np.stack([a, far, near, -far]), 0.95)
    [[(first, one), (second, sim)]] = groups
    assert (first, one) == ("a", 1.0)
    assert second == "c" and sim == pytest.approx(0.99 / np.linalg.norm(near), abs=1e-6)


def test_empty_and_one_item_jobs_have_no_groups() -> None:
    assert cosine_groups([], np.empty((0, 4)), 0.9) == []
    assert cosine_groups(["only"], np.ones((1, 4)), 0.9) == []


def test_vectors_without_a_direction_are_refused() -> None:
    with pytest.raises(InputError, match="1 vector\\(s\\) hold NaN or infinity"):
        cosine_pairs(np.array([[1.0, 0.0], [np.nan, 1.0]]), 0.9)
    with pytest.raises(InputError, match="length 0"):
        cosine_pairs(np.zeros((2, 3)), 0.9)
    with pytest.raises(ValueError, match="between -1 and 1"):
        cosine_pairs(np.ones((2, 3)), 1.5)


def test_neighbour_pairs_decide_on_the_rows_not_the_half_precision_index() -> None:
    """The index keeps float16 vectors, whose cosines are off by up to ~1e-3: a pair is kept
    or dropped by its float32 rows' cosine, to the threshold's last digit."""
    rng = np.random.default_rng(7)
    base = rng.standard_normal(64).astype(np.float32)
    base /= np.linalg.norm(base)
    other = rng.standard_normal(64).astype(np.float32)
    other -= other @ base * base
    other /= np.linalg.norm(other)
    cosine = 0.92013
    rows = np.stack([base, cosine * base + np.sqrt(1 - cosine**2) * other]).astype(np.float32)
    exact = float(rows[0] @ rows[1])
    index = VectorIndex.build(["a", "b"], rows)
    labels = np.array([index.label_of("a"), index.label_of("b")])
    assert neighbour_pairs(index, rows, labels, exact - 1e-5).tolist() == [[0, 1]]
    assert neighbour_pairs(index, rows, labels, exact + 1e-5).tolist() == []
