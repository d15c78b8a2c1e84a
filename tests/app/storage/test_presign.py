"""`presign`: S3 signs a short-lived GET URL (moto serves it); a local folder cannot."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from kiln.app.core.config import get_settings
from kiln.app.core.errors import ConflictError
from kiln.app.storage.local import LocalStore
from kiln.app.storage.s3 import S3Store, make_s3_client
from tests.app.storage.conftest import BUCKET, PREFIX
from tests.sigv4 import s3_would_accept


@pytest.fixture
def store(s3: Any, tmp_path: Path) -> S3Store:
    """On Kiln's own client (SigV4 presigning), which moto intercepts like any other."""
    return S3Store(make_s3_client(get_settings(data_dir=tmp_path)), BUCKET, PREFIX)


def secret() -> str:
    return os.environ["AWS_SECRET_ACCESS_KEY"]  # moto's stand-in while it mocks


def test_s3_presigns_a_get_url_of_the_key(store: S3Store) -> None:
    store.put("results/job/manifest.json", b'{"ok": true}', "application/json")
    url = store.presign("results/job/manifest.json", 120)
    parts = urlsplit(url)
    assert BUCKET in parts.netloc + parts.path
    assert parts.path.endswith(f"/{PREFIX}results/job/manifest.json")
    assert "X-Amz-Expires=120" in url and "X-Amz-Signature=" in url  # SigV4, not SigV2
    assert requests.get(url, timeout=10).content == b'{"ok": true}'  # moto answers it


def test_the_url_is_bound_to_its_key_its_expiry_and_the_secret(store: S3Store) -> None:
    url = store.presign("results/job/manifest.json", 60)
    assert s3_would_accept(url, secret())
    assert not s3_would_accept(url.replace("manifest.json", "part-000000.parquet"), secret())
    assert not s3_would_accept(url.replace("X-Amz-Expires=60", "X-Amz-Expires=3600"), secret())
    assert not s3_would_accept(url, "another-secret")
    later = datetime.now(UTC) + timedelta(seconds=61)
    assert not s3_would_accept(url, secret(), now=later)


def test_a_local_store_cannot_presign(tmp_path: Path) -> None:
    with pytest.raises(ConflictError, match="Presigned URLs need S3 storage"):
        LocalStore(tmp_path).presign("results/job/manifest.json", 60)
