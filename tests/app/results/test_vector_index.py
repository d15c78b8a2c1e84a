"""The vector index (app/results/vector_index.py): search order, updates, storage, and the
approximate path agreeing with the exact one on small sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.app.results import vector_index
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage.local import LocalStore
from kiln.workers.models.grouping import cosine_groups, cosine_pairs, neighbour_pairs, unit_rows


def planted(originals: int, copies: int, dim: int = 64, seed: int = 0) -> np.ndarray:
    """Random unit originals, each followed by `copies` near copies (cosine ≈ 0.98)."""
    rng = np.random.default_rng(seed)
    base = unit_rows(rng.standard_normal((originals, dim)))
    noisy = [base + 0.1 * rng.standard_normal(base.shape) / np.sqrt(dim) for _ in range(copies)]
    return np.concatenate([base, *noisy]).astype(np.float32)


def test_search_answers_the_nearest_first_with_cosine_similarity() -> None:
    index = VectorIndex.build(["x", "y", "z"], np.eye(3, dtype=np.float32))
    [found] = index.search(np.asarray([[1.0, 0.2, 0.0]], np.float32), 2)
    assert [n.key for n in found] == ["x", "y"]
    assert found[0].similarity == pytest.approx(1 / np.sqrt(1.04), abs=1e-5)


def test_k_beyond_the_index_answers_what_there_is() -> None:
    index = VectorIndex.build(["x", "y"], np.eye(2, dtype=np.float32))
    assert len(index.search(np.eye(2, dtype=np.float32), 10)[0]) == 2
    assert VectorIndex.empty(2).search(np.eye(2, dtype=np.float32), 3) == [[], []]


def test_adding_a_key_again_replaces_it_and_removal_frees_it() -> None:
    index = VectorIndex.build(["x", "y"], np.eye(2, dtype=np.float32))
    index.add(["x"], np.asarray([[0.0, 1.0]], np.float32))
    assert len(index) == 2
    assert index.vector_of("x") == pytest.approx([0.0, 1.0])
    assert index.remove(["y", "not-there"]) == 1
    assert "y" not in index and index.vector_of("y") is None
    assert [n.key for n in index.search(np.asarray([[1.0, 0.0]], np.float32), 5)[0]] == ["x"]


@pytest.mark.parametrize("mapped", [False, True])
def test_saved_and_loaded_back(tmp_path: Path, mapped: bool) -> None:
    place = Place(LocalStore(tmp_path / "store"), "results/j/")
    vectors = planted(50, 1)
    keys = [f"k{i}" for i in range(len(vectors))]
    summary = VectorIndex.build(keys, vectors).save(place)
    assert summary["vectors"] == 100 and summary["dim"] == 64
    assert vector_index.exists(place)
    assert vector_index.stored_bytes(place) == summary["bytes"]

    local = tmp_path / "cache" / "j.usearch" if mapped else None
    loaded = vector_index.load(place, local)
    assert len(loaded) == 100
    [found] = loaded.search(vectors[7:8], 2)
    assert [n.key for n in found] == ["k7", "k57"]  # itself, then its planted copy


def test_approximate_pairs_agree_with_exact_ones_on_a_small_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vectors = planted(300, 3, seed=1)
    keys = [f"k{i}" for i in range(len(vectors))]
    index = VectorIndex.build(keys, vectors)
    rows = unit_rows(vectors)
    exact = {tuple(p) for p in cosine_pairs(rows, 0.9).tolist()}
    monkeypatch.setattr(vector_index, "EXACT_MAX", 10)  # force the graph search
    assert not index.exact
    approx = {tuple(p) for p in neighbour_pairs(index, rows, np.arange(len(rows)), 0.9).tolist()}
    assert len(exact) == 300 * 6  # each original with its 3 copies
    # a graph search may miss a pair now and then (it is approximate: threads build the graph
    # in no fixed order), never invent one; chains keep the groups whole
    assert approx <= exact and len(approx) >= 0.99 * len(exact)
    groups = cosine_groups(keys, vectors, 0.9, index)
    assert len(groups) == 300 and all(len(g) == 4 for g in groups)
    assert groups == cosine_groups(keys, vectors, 0.9)


def test_empty_and_one_item_sets_have_no_groups() -> None:
    assert cosine_groups([], np.empty((0, 3), np.float32), 0.9) == []
    one = np.asarray([[1.0, 0.0, 0.0]], np.float32)
    assert cosine_groups(["a"], one, 0.9, VectorIndex.build(["a"], one)) == []
