"""`LocalStore`: what only a folder does. The shared behaviour is in test_contract.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.app.core.errors import NotFoundError
from kiln.app.storage.local import LocalStore
from tests.app.storage.test_base import INVALID_KEYS


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


def test_put_leaves_no_temporary_files(store: LocalStore) -> None:
    store.put("a/b", b"first")
    store.put("a/b", b"second")
    assert [p.name for p in (store.root / "a").iterdir()] == ["b"]


def test_list_skips_temporary_files(store: LocalStore) -> None:
    store.put("a/b", b"x")
    (store.root / "a" / ".tmp-half-written").write_bytes(b"partial")
    assert list(store.list("")) == ["a/b"]


def test_list_of_a_store_that_was_never_written(tmp_path: Path) -> None:
    assert list(LocalStore(tmp_path / "nowhere").list("")) == []


def test_get_missing_key_names_a_file_url(store: LocalStore) -> None:
    with pytest.raises(NotFoundError, match="No object at file://"):
        store.get("missing/key")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_write_nothing_outside_the_root(store: LocalStore, key: str) -> None:
    with pytest.raises(ValueError, match="not a valid object key"):
        store.put(key, b"x")
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
