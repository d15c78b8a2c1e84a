"""Fixtures shared by the storage tests: moto's S3 and `any_store`, one of each backend."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from kiln.app.storage.base import ObjectStore
from kiln.app.storage.local import LocalStore
from kiln.app.storage.s3 import S3Store

BUCKET = "kiln-test"
PREFIX = "jobs/"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A boto3 client on moto's in-process S3, with `BUCKET` created."""
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


@pytest.fixture(params=["local", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """Each `ObjectStore` backend in turn, empty; moto starts only for the S3 one."""
    if request.param == "local":
        # A root that does not exist yet, as on a fresh install.
        return LocalStore(tmp_path / "objects")
    return S3Store(request.getfixturevalue("s3"), BUCKET, PREFIX)
