"""`S3Store` against moto's in-process S3."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from app.core.config import get_settings
from app.core.errors import KilnError, NotFoundError
from app.storage import open_store
from app.storage.local import LocalStore
from app.storage.s3 import S3Store, parse_s3_uri
from tests.app.storage.test_base import INVALID_KEYS

BUCKET = "kiln-test"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


@pytest.fixture
def store(s3: Any) -> S3Store:
    return S3Store(s3, BUCKET, "jobs/")


def test_round_trip(store: S3Store, s3: Any) -> None:
    store.put("results/job/part-000000.parquet", b"one", "application/vnd.apache.parquet")
    store.put("results/job/manifest.json", b"{}")
    store.put("other/x", b"")
    assert store.get("results/job/part-000000.parquet") == b"one"
    assert store.get("other/x") == b""
    head = s3.head_object(Bucket=BUCKET, Key="jobs/results/job/part-000000.parquet")
    assert head["ContentType"] == "application/vnd.apache.parquet"
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
    assert list(store.list("results/")) == ["results/job/part-000000.parquet"]
    store.delete("never/written")


def test_keys_live_under_the_prefix(store: S3Store, s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="outside", Body=b"not ours")
    store.put("a/b", b"x")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert sorted(keys) == ["jobs/a/b", "outside"]
    assert list(store.list("")) == ["a/b"]
    assert store.describe("a/b") == f"s3://{BUCKET}/jobs/a/b"


def test_list_matches_local_store(store: S3Store, tmp_path: Path) -> None:
    local = LocalStore(tmp_path)
    for key in ["r/j/part-000001.parquet", "r/j/part-000000.parquet", "r/k/x", "r/j/manifest.json"]:
        store.put(key, b"x")
        local.put(key, b"x")
    for prefix in ["", "r/", "r/j/", "r/j/part-", "r/none"]:
        assert list(store.list(prefix)) == list(local.list(prefix))


def test_get_missing_key_raises_not_found(store: S3Store) -> None:
    with pytest.raises(NotFoundError, match=f"s3://{BUCKET}/jobs/missing/key"):
        store.get("missing/key")


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_invalid_keys_raise_value_error(store: S3Store, key: str) -> None:
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.get(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(ValueError, match="not a valid object key"):
            call()


def test_ping(store: S3Store) -> None:
    store.ping()


def test_ping_a_missing_bucket_names_it(s3: Any) -> None:
    store = S3Store(s3, "kiln-no-such-bucket")
    with pytest.raises(KilnError) as info:
        store.ping()
    assert "s3://kiln-no-such-bucket" in str(info.value)
    assert str(info.value).endswith(".")


def test_get_from_a_missing_bucket_is_a_kiln_error(s3: Any) -> None:
    store = S3Store(s3, "kiln-no-such-bucket")
    with pytest.raises(KilnError, match="s3://kiln-no-such-bucket/k"):
        store.get("k")
    with pytest.raises(KilnError, match="s3://kiln-no-such-bucket"):
        list(store.list(""))


def test_open_store_round_trip(s3: Any, tmp_path: Path) -> None:
    settings = get_settings(data_dir=tmp_path, storage_url=f"s3://{BUCKET}/via/settings")
    store = open_store(settings)
    assert isinstance(store, S3Store)
    store.ping()
    store.put("k", b"v")
    assert store.get("k") == b"v"
    assert s3.get_object(Bucket=BUCKET, Key="via/settings/k")["Body"].read() == b"v"


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://bucket", ("bucket", "")),
        ("s3://bucket/", ("bucket", "")),
        ("s3://bucket/a/b.jpg", ("bucket", "a/b.jpg")),
    ],
)
def test_parse_s3_uri(uri: str, expected: tuple[str, str]) -> None:
    assert parse_s3_uri(uri) == expected


@pytest.mark.parametrize("uri", ["file:///tmp/x", "s3:///key", "bucket/key"])
def test_parse_s3_uri_rejects_others(uri: str) -> None:
    from app.core.errors import InputError

    with pytest.raises(InputError, match="not an S3 URI"):
        parse_s3_uri(uri)


def test_get_below_an_existing_object_is_not_found(store: S3Store) -> None:
    """The behaviour `LocalStore` must match: `a/b` is a missing key even if `a` exists."""
    store.put("a", b"x")
    assert not store.exists("a/b")
    with pytest.raises(NotFoundError):
        store.get("a/b")
