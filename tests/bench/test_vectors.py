"""Issue 17's vector index bench: the planted set and the recall computations, on tiny sets.
No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest

from bench.planted_vectors import PlantedSet, near, planted_set
from bench.vectors import agreement, exact_top, markdown, measure, planted_scores, recall_at_k


def test_planted_set_has_its_copies_at_their_similarity() -> None:
    data = planted_set(2000, dim=32, copy_share=0.25, similarity=(0.93, 0.99), seed=3)
    rows = np.arange(2000)
    assert data.vectors.shape == (2000, 32) and data.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(data.vectors, axis=1), 1.0, atol=1e-5)
    is_copy = data.source != rows
    assert data.copies == is_copy.sum() == 500
    # a copy's source is an original, never another copy
    assert (data.source[data.source[is_copy]] == data.source[is_copy]).all()
    cosine = np.einsum("ij,ij->i", data.vectors, data.vectors[data.source])
    np.testing.assert_allclose(cosine, data.similarity, atol=1e-5)
    assert data.similarity[is_copy].min() >= 0.93 and data.similarity[is_copy].max() <= 0.99
    assert data.copied_originals == len(np.unique(data.source[is_copy]))
    # copies are spread through the rows, not all at the end
    assert is_copy[:1000].sum() > 150


def test_planted_set_is_seeded() -> None:
    one, again = planted_set(300, dim=8, seed=1), planted_set(300, dim=8, seed=1)
    np.testing.assert_array_equal(one.vectors, again.vectors)
    np.testing.assert_array_equal(one.source, again.source)
    assert not np.array_equal(one.vectors, planted_set(300, dim=8, seed=2).vectors)
    with pytest.raises(ValueError, match="n >= 2"):
        planted_set(1)


def test_near_rows_are_exactly_that_alike() -> None:
    rng = np.random.default_rng(0)
    base = planted_set(50, dim=16, copy_share=0.0).vectors
    moved = near(base, np.full(50, 0.9), rng)
    np.testing.assert_allclose(np.einsum("ij,ij->i", base, moved), 0.9, atol=1e-5)


def _tiny() -> tuple[PlantedSet, list[str]]:
    # rows 0-2: one original (0) and two copies; 3-4: another; 5 alone
    source = np.array([0, 0, 0, 3, 3, 5])
    vectors = np.eye(6, dtype=np.float32)
    return PlantedSet(vectors, source, np.ones(6, np.float32)), list("abcdef")


def test_planted_scores_count_pairs_of_one_original() -> None:
    data, keys = _tiny()
    assert data.copies == 3 and data.copied_originals == 2
    perfect = planted_scores(data, keys, [["a", "b", "c"], ["d", "e"]])
    assert (perfect.true_pairs, perfect.recall, perfect.precision) == (4, 1.0, 1.0)
    # {a, b} found, c missed; d, e joined to f by mistake
    partial = planted_scores(data, keys, [["a", "b"], ["d", "e", "f"]])
    assert partial.correct_pairs == 2 and partial.recall == 0.5
    assert partial.precision == pytest.approx(2 / 4)


def test_agreement_is_recall_of_the_exact_groups() -> None:
    keys = list("abcdef")
    exact = [["a", "b", "c"], ["d", "e"]]
    split = agreement(keys, exact, [["a", "b"], ["d", "e"]])  # c split off: 2 of 4 pairs lost
    assert split.recall == pytest.approx(2 / 4) and split.precision == 1.0
    assert agreement(keys, exact, exact).recall == 1.0


def test_search_recall_against_brute_force() -> None:
    vectors = np.eye(5, dtype=np.float32)
    queries = np.array([[1, 0.5, 0, 0, 0], [0, 0, 0.2, 1, 0]], np.float32)
    truth = exact_top(vectors, queries, 2, block=1)
    assert [sorted(t) for t in truth.tolist()] == [[0, 1], [2, 3]]
    assert recall_at_k([[0, 1], [3, 4]], truth) == pytest.approx(0.75)


def test_one_size_measures_every_phase() -> None:
    out = measure(n=600, dim=16, queries=60, exact_up_to=600, seed=0)
    assert set(out["phases"]) == {
        "generate", "build", "group", "group_exact", "save", "load", "load_mapped",
    }  # fmt: skip
    assert out["loaded_vectors"] == 600 and out["saved"]["vectors"] == 600
    assert out["group"]["vs_planted"]["recall"] == 1.0  # 600 vectors: the exact path
    assert out["approx_vs_exact"]["recall"] == 1.0
    assert out["search_built"]["recall_at_k"] == 1.0
    assert out["peak_rss_mb"] > 0
    assert "600" in markdown([out])
