"""A worker reading an upload from Kiln's own bucket, missing, meets a `SetupError`: transient
(the prep unit, then the chunk, is retried; no item fails for the operator's fault), while a
bucket the user named that is missing fails that item with its sentence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from moto import mock_aws

from kiln.app import sources
from kiln.app.core.config import get_settings
from kiln.app.core.errors import InputError, SetupError, TransientError
from kiln.app.storage import open_store
from kiln.workers.prep.fetch import Fetcher
from kiln.workers.prep.settings import PrepSettings


@pytest.fixture
def fetcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fetcher]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        settings = get_settings(data_dir=tmp_path, storage_url="s3://kiln-trial/kiln")
        yield Fetcher(PrepSettings.of(settings), open_store(settings))


def test_kilns_missing_bucket_is_retried_not_the_items_fault(fetcher: Fetcher) -> None:
    with pytest.raises(SetupError, match="Kiln's storage bucket kiln-trial does not exist") as info:
        fetcher.fetch(sources.in_store("jobs/j/inputs/000000"), 1000)
    assert isinstance(info.value, TransientError)  # PrepProcess re-raises: the unit retries


def test_a_users_missing_bucket_fails_the_item(fetcher: Fetcher) -> None:
    with pytest.raises(InputError, match=r"The bucket of s3://photos/cat.jpg does not exist\."):
        fetcher.fetch("s3://photos/cat.jpg", 1000)
