"""`check_key` and `open_store`."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.app.core.config import get_settings
from kiln.app.storage import open_store
from kiln.app.storage.base import check_key
from kiln.app.storage.local import LocalStore
from kiln.app.storage.s3 import S3Store

INVALID_KEYS = ["", "/abs/key", "../escape", "a/../b", "a/./b", "./a", "a//b", "a/", ".", ".."]


@pytest.mark.parametrize("key", ["a", "a/b/c.parquet", "results/job/part-000001.parquet", "a..b"])
def test_check_key_accepts_relative_paths(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize("key", INVALID_KEYS)
def test_check_key_rejects_escapes_and_empty_parts(key: str) -> None:
    with pytest.raises(ValueError, match="not a valid object key"):
        check_key(key)


def test_open_store_file_url(tmp_path: Path) -> None:
    store = open_store(get_settings(data_dir=tmp_path, storage_url=(tmp_path / "o").as_uri()))
    assert isinstance(store, LocalStore)
    assert store.root == (tmp_path / "o").resolve()


def test_open_store_defaults_to_a_folder_under_the_data_dir(tmp_path: Path) -> None:
    store = open_store(get_settings(data_dir=tmp_path, storage_url=""))
    assert isinstance(store, LocalStore)
    assert store.root == (tmp_path / "objects").resolve()


def test_open_store_s3_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    settings = get_settings(data_dir=tmp_path, storage_url="s3://kiln-bucket/some/prefix/")
    store = open_store(settings)  # builds a client; nothing connects
    assert isinstance(store, S3Store)
    assert store.bucket == "kiln-bucket"
    assert store.prefix == "some/prefix/"


@pytest.mark.parametrize("url", ["ftp://host/path", "/plain/path", "gs://bucket/prefix"])
def test_open_store_rejects_other_schemes(tmp_path: Path, url: str) -> None:
    settings = get_settings(data_dir=tmp_path, storage_url=url)
    with pytest.raises(
        ValueError, match="KILN_STORAGE_URL must start with s3:// or file://"
    ) as info:
        open_store(settings)
    message = str(info.value)
    assert url in message
    assert message.endswith(".")
