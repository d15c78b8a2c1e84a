"""`S3Store` against moto's in-process S3: what only S3 does. The shared behaviour is in
test_contract.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kiln.app.core.config import get_settings
from kiln.app.core.errors import InputError, KilnError, NotFoundError
from kiln.app.storage import open_store
from kiln.app.storage.s3 import S3Store, parse_s3_uri
from tests.app.storage.conftest import BUCKET, PREFIX


@pytest.fixture
def store(s3: Any) -> S3Store:
    return S3Store(s3, BUCKET, PREFIX)


def test_put_records_the_content_type(store: S3Store, s3: Any) -> None:
    store.put("results/job/part-000000.parquet", b"one", "application/vnd.apache.parquet")
    head = s3.head_object(Bucket=BUCKET, Key="jobs/results/job/part-000000.parquet")
    assert head["ContentType"] == "application/vnd.apache.parquet"


def test_keys_live_under_the_prefix(store: S3Store, s3: Any) -> None:
    s3.put_object(Bucket=BUCKET, Key="outside", Body=b"not ours")
    store.put("a/b", b"x")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert sorted(keys) == ["jobs/a/b", "outside"]
    assert list(store.list("")) == ["a/b"]
    assert store.describe("a/b") == f"s3://{BUCKET}/jobs/a/b"


def test_get_missing_key_names_bucket_and_prefix(store: S3Store) -> None:
    with pytest.raises(NotFoundError, match=f"s3://{BUCKET}/jobs/missing/key"):
        store.get("missing/key")


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
    with pytest.raises(InputError, match="not an S3 URI"):
        parse_s3_uri(uri)
