"""What every `ObjectStore` must do alike, run against `LocalStore` and `S3Store` (moto)."""

from __future__ import annotations

import pytest

from kiln.app.core.errors import KilnError, NotFoundError
from kiln.app.storage.base import NewObject, ObjectStore
from tests.app.storage.test_base import INVALID_KEYS


def test_round_trip(any_store: ObjectStore) -> None:
    store = any_store
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


def test_put_overwrites(any_store: ObjectStore) -> None:
    any_store.put("a/b", b"first")
    any_store.put("a/b", b"second")
    assert any_store.get("a/b") == b"second"
    assert list(any_store.list("")) == ["a/b"]


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        (
            "",
            ["r/j/manifest.json", "r/j/part-000000.parquet", "r/j/part-000001.parquet", "r/k/x"],
        ),
        (
            "r/",
            ["r/j/manifest.json", "r/j/part-000000.parquet", "r/j/part-000001.parquet", "r/k/x"],
        ),
        ("r/j/", ["r/j/manifest.json", "r/j/part-000000.parquet", "r/j/part-000001.parquet"]),
        ("r/j/part-", ["r/j/part-000000.parquet", "r/j/part-000001.parquet"]),
        ("r/none", []),
    ],
)
def test_list_is_sorted_and_filtered_by_prefix(
    any_store: ObjectStore, prefix: str, expected: list[str]
) -> None:
    """Both backends give these same lists, so `LocalStore` lists as S3 does."""
    for key in ["r/j/part-000001.parquet", "r/j/part-000000.parquet", "r/k/x", "r/j/manifest.json"]:
        any_store.put(key, b"x")
    assert list(any_store.list(prefix)) == expected


def test_delete_of_a_missing_key_is_quiet(any_store: ObjectStore) -> None:
    any_store.delete("never/written")
    assert not any_store.exists("never/written")


def test_get_missing_key_raises_not_found_naming_the_object(any_store: ObjectStore) -> None:
    with pytest.raises(NotFoundError) as info:
        any_store.get("missing/key")
    assert isinstance(info.value, KilnError)
    assert "missing/key" in str(info.value)
    assert str(info.value) == f"No object at {any_store.describe('missing/key')}."


def test_get_of_a_folder_is_not_found(any_store: ObjectStore) -> None:
    """`a` only prefixes an object, so it is not one itself."""
    any_store.put("a/b", b"x")
    assert not any_store.exists("a")
    with pytest.raises(NotFoundError):
        any_store.get("a")


def test_get_below_an_existing_object_is_not_found(any_store: ObjectStore) -> None:
    """`a` is an object, so `a/b` is simply a missing key (on a folder as on S3)."""
    any_store.put("a", b"x")
    assert not any_store.exists("a/b")
    with pytest.raises(NotFoundError):
        any_store.get("a/b")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_raise_value_error(any_store: ObjectStore, key: str) -> None:
    for call in (
        lambda: any_store.put(key, b"x"),
        lambda: any_store.get(key),
        lambda: any_store.exists(key),
        lambda: any_store.delete(key),
    ):
        with pytest.raises(ValueError, match="not a valid object key"):
            call()
    assert list(any_store.list("")) == []


def test_ping(any_store: ObjectStore) -> None:
    any_store.ping()


def test_listing_is_in_whole_key_order(any_store) -> None:
    """S3 sorts whole keys; a folder-by-folder walk would put `a/b` before `a-c`."""
    for key in ("a/b", "a-c", "a.d/e", "a0"):
        any_store.put(key, b"x")
    assert list(any_store.list("")) == ["a-c", "a.d/e", "a/b", "a0"]


def test_put_new_writes_every_object(any_store: ObjectStore) -> None:
    objects = [
        NewObject(f"jobs/j/inputs/{i:06d}", bytes([i]) * (i + 1), "image/png") for i in range(12)
    ]
    any_store.put_new(objects)
    any_store.put_new([])
    assert list(any_store.list("jobs/j/")) == [o.key for o in objects]
    assert [any_store.get(o.key) for o in objects] == [o.data for o in objects]
