"""The API's cache of vector indexes (app/results/index_cache.py): loaded once, least recently used
out first within its byte budget, large ones memory-mapped, one too large refused with a
sentence."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from kiln.app.core.errors import ConflictError
from kiln.app.results import vector_index
from kiln.app.results.index_cache import KEY_BYTES, SLACK, IndexCache
from kiln.app.results.results import Place
from kiln.app.results.vector_index import VectorIndex
from kiln.app.storage.local import LocalStore

DIM, COUNT = 16, 200


def stored(tmp_path: Path, name: str, seed: int = 0) -> Place:
    vectors = np.random.default_rng(seed).standard_normal((COUNT, DIM)).astype(np.float32)
    place = Place(LocalStore(tmp_path / "objects"), f"results/{name}/")
    VectorIndex.build([f"{name}-{i}" for i in range(COUNT)], vectors).save(place)
    return place


def cost(place: Place) -> int:
    """What one index of these counts against the budget, measured by loading one."""
    cache = IndexCache(max_bytes=1 << 40)
    cache.get("probe", place)
    return cache.held_bytes


def test_an_index_is_loaded_once_and_then_served_from_memory(tmp_path: Path) -> None:
    place = stored(tmp_path, "a")
    cache = IndexCache(max_bytes=1 << 30)
    first = cache.get("a", place)
    place.store.delete(place.key(vector_index.INDEX))  # a second load would fail now
    assert cache.get("a", place) is first and "a" in cache
    assert cache.held_bytes == int(vector_index.stored_bytes(place) * SLACK) + KEY_BYTES * COUNT


def test_the_least_recently_used_index_goes_first(tmp_path: Path) -> None:
    places = {name: stored(tmp_path, name, seed) for seed, name in enumerate("abc")}
    cache = IndexCache(max_bytes=2 * cost(places["a"]) + 1)  # room for two
    cache.get("a", places["a"])
    cache.get("b", places["b"])
    cache.get("a", places["a"])  # "a" is now the more recently used
    cache.get("c", places["c"])
    assert ("a" in cache, "b" in cache, "c" in cache) == (True, False, True)


def test_an_index_larger_than_the_budget_is_refused_with_a_sentence(tmp_path: Path) -> None:
    place = stored(tmp_path, "big")
    cache = IndexCache(max_bytes=1024)
    with pytest.raises(ConflictError, match="KILN_SEARCH_CACHE_BYTES") as refused:
        cache.get("big", place)
    assert "job big takes" in str(refused.value) and str(refused.value).endswith(".")
    assert "big" not in cache and cache.held_bytes == 0


def test_large_indexes_are_memory_mapped_and_search_alike(tmp_path: Path) -> None:
    places = {name: stored(tmp_path, name, seed) for seed, name in enumerate("ab")}
    mapped = IndexCache(max_bytes=cost(places["a"]) + 1, mmap_from=0)  # room for one
    in_memory = IndexCache(max_bytes=1 << 30)
    query = np.random.default_rng(9).standard_normal((3, DIM)).astype(np.float32)
    found = mapped.get("a", places["a"]).search(query, 5)
    assert found == in_memory.get("a", places["a"]).search(query, 5)
    folder = mapped.folder
    assert folder is not None and (folder / "a.usearch").is_file()
    mapped.get("b", places["b"])  # evicts "a": its file goes with it
    assert not (folder / "a.usearch").exists() and (folder / "b.usearch").is_file()
    mapped.close()
    assert not folder.exists()


def test_searches_arriving_together_share_one_load(tmp_path: Path) -> None:
    place = stored(tmp_path, "a")
    cache = IndexCache(max_bytes=1 << 30)
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: cache.get("a", place), range(16)))
    assert all(index is loaded[0] for index in loaded)
