"""`LocalStore`: a folder behind the `ObjectStore` protocol."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.errors import KilnError, NotFoundError
from app.storage.local import LocalStore
from tests.app.storage.test_base import INVALID_KEYS


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


def test_round_trip(store: LocalStore) -> None:
    store.put("results/job/part-000000.parquet", b"one", "application/vnd.apache.parquet")
    store.put("results/job/manifest.json", b"{}")
    store.put("other/x", b"")
    assert store.get("results/job/part-000000.parquet") == b"one"
    assert store.get("other/x") == b""
    assert store.exists("results/job/manifest.json")
    assert not store.exists("results/job/missing")
    assert list(store.list("results/job/")) == [
        "results/job/manifest.json",
        "results/job/part-000000.parquet",
    ]
    assert list(store.list("")) == [
        "other/x",
        "results/job/manifest.json",
        "results/job/part-000000.parquet",
    ]
    assert list(store.list("nothing/")) == []

    store.delete("results/job/manifest.json")
    assert not store.exists("results/job/manifest.json")
    with pytest.raises(NotFoundError):
        store.get("results/job/manifest.json")
    assert list(store.list("results/")) == ["results/job/part-000000.parquet"]


def test_put_overwrites_and_leaves_no_temporary_files(store: LocalStore) -> None:
    store.put("a/b", b"first")
    store.put("a/b", b"second")
    assert store.get("a/b") == b"second"
    assert [p.name for p in (store.root / "a").iterdir()] == ["b"]
    assert list(store.list("")) == ["a/b"]


def test_list_skips_temporary_files(store: LocalStore) -> None:
    store.put("a/b", b"x")
    (store.root / "a" / ".tmp-half-written").write_bytes(b"partial")
    assert list(store.list("")) == ["a/b"]


def test_list_of_a_store_that_was_never_written(tmp_path: Path) -> None:
    assert list(LocalStore(tmp_path / "nowhere").list("")) == []


def test_delete_of_a_missing_key_is_quiet(store: LocalStore) -> None:
    store.delete("never/written")


def test_get_missing_key_raises_not_found_with_a_url(store: LocalStore) -> None:
    with pytest.raises(NotFoundError, match="No object at file://") as info:
        store.get("missing/key")
    assert isinstance(info.value, KilnError)
    assert "missing/key" in str(info.value)


def test_get_of_a_folder_is_not_found(store: LocalStore) -> None:
    store.put("a/b", b"x")
    assert not store.exists("a")
    with pytest.raises(NotFoundError):
        store.get("a")


def test_get_below_an_existing_object_is_not_found(store: LocalStore) -> None:
    """`a` is an object, so `a/b` is simply a missing key (as it would be on S3)."""
    store.put("a", b"x")
    assert not store.exists("a/b")
    with pytest.raises(NotFoundError):
        store.get("a/b")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_raise_value_error(store: LocalStore, key: str) -> None:
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.get(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(ValueError, match="not a valid object key"):
            call()
    assert not (store.root.parent / "escape").exists()


def test_from_url_decodes_the_path(tmp_path: Path) -> None:
    root = tmp_path / "with space"
    store = LocalStore.from_url(root.as_uri())
    assert store.root == root.resolve()
    store.put("k", b"v")
    assert (root / "k").read_bytes() == b"v"
    assert store.describe("k") == (root / "k").resolve().as_uri()


def test_ping_creates_the_root(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "new" / "root")
    store.ping()
    assert store.root.is_dir()
