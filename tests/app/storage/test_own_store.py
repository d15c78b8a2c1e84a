"""Kiln's own store (`KILN_STORAGE_URL`) against a bucket a user names: a missing or refused
bucket of Kiln's is the service's misconfiguration (`SetupError`, a 503), a user's stays the
user's error (`InputError`). And `kiln storage check [--create]`, on moto's in-process S3 and
on a local folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError, NoCredentialsError
from typer.testing import CliRunner

from kiln.app.cli.commands import app
from kiln.app.core.config import get_settings
from kiln.app.core.errors import InputError, SetupError, TransientError
from kiln.app.storage import open_store
from kiln.app.storage.check import check_store
from kiln.app.storage.local import LocalStore
from kiln.app.storage.s3 import S3Store

MISSING = "kiln-trial"


def flat(text: str) -> str:
    """Console output without the line wrapping of an 80-column terminal."""
    return " ".join(text.split())


def test_open_store_is_kilns_own(s3: Any, tmp_path: Path) -> None:
    store = open_store(get_settings(data_dir=tmp_path, storage_url=f"s3://{MISSING}/kiln"))
    assert isinstance(store, S3Store) and store.own


@pytest.mark.parametrize(
    "use",
    [
        lambda store: store.ping(),
        lambda store: store.get("k"),
        lambda store: store.put("k", b"v"),
        lambda store: list(store.list("")),
        lambda store: store.delete("k"),
    ],
    ids=["ping", "get", "put", "list", "delete"],
)
def test_kilns_missing_bucket_is_a_setup_error_naming_it(s3: Any, use: Any) -> None:
    with pytest.raises(SetupError) as info:
        use(S3Store(s3, MISSING, "kiln", own=True))
    assert str(info.value) == (
        f"Kiln's storage bucket {MISSING} does not exist (KILN_STORAGE_URL); "
        "create it with `kiln storage check --create`."
    )
    assert isinstance(info.value, TransientError)  # a 503, and a task retries it


def test_a_users_missing_bucket_stays_the_users_error(s3: Any) -> None:
    users = S3Store(s3, "photos-nobody-made", "results")
    with pytest.raises(InputError, match="does not exist"):
        users.put("k", b"v")
    with pytest.raises(InputError, match="s3://photos-nobody-made"):
        users.ping()


class Refusing:
    """A client whose every call raises `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def call(**_: Any) -> Any:
            raise self.error

        return call


def denied(operation: str) -> ClientError:
    return ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, operation)


def test_kilns_bucket_refused_is_a_setup_error() -> None:
    store = S3Store(Refusing(denied("PutObject")), "kiln-store", own=True)
    with pytest.raises(SetupError, match="Kiln may not use its storage bucket kiln-store"):
        store.put("k", b"v")
    users = S3Store(Refusing(denied("PutObject")), "photos")
    with pytest.raises(InputError, match=r"Access to s3://photos/k was refused \(AccessDenied\)"):
        users.put("k", b"v")


def test_no_credentials_names_what_to_set() -> None:
    store = S3Store(Refusing(NoCredentialsError()), "kiln-store", own=True)
    with pytest.raises(SetupError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        store.ping()


def test_check_creates_a_missing_bucket_then_finds_it(s3: Any) -> None:
    store = S3Store(s3, MISSING, "kiln", own=True)
    with pytest.raises(SetupError, match="does not exist"):
        list(check_store(store))
    said = list(check_store(store, create=True))
    assert said[0] == f"Created the bucket {MISSING}."
    assert said[1].startswith(
        f"Wrote, read back and deleted s3://{MISSING}/kiln/kiln-storage-check/"
    )
    assert said[1].endswith(": the store works.")
    assert s3.list_objects_v2(Bucket=MISSING).get("KeyCount") == 0  # the probe is gone
    assert list(check_store(store, create=True))[:1] == [f"The bucket {MISSING} exists."]
    store.ping()


def test_check_a_local_folder(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    said = list(check_store(store))
    assert said[0] == f"Created the folder {tmp_path / 'objects'}."
    assert said[1].endswith(": the store works.")
    assert list(check_store(store))[:1] == [f"The folder {tmp_path / 'objects'} exists."]
    assert [p for p in (tmp_path / "objects").rglob("*") if p.is_file()] == []


@pytest.fixture
def kiln(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    for name in [n for n in os.environ if n.upper().startswith("KILN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path / "data"))
    return CliRunner()


def test_kiln_storage_check_command(
    kiln: CliRunner, s3: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_STORAGE_URL", f"s3://{MISSING}/kiln")
    missing = kiln.invoke(app, ["storage", "check"])
    assert missing.exit_code == 1, missing.output
    assert f"Kiln's store is s3://{MISSING}/kiln (KILN_STORAGE_URL)." in flat(missing.output)
    assert f"Kiln's storage bucket {MISSING} does not exist" in flat(missing.output)

    created = kiln.invoke(app, ["storage", "check", "--create"])
    assert created.exit_code == 0, created.output
    assert f"Created the bucket {MISSING}." in created.output
    assert "the store works." in created.output
    again = kiln.invoke(app, ["storage", "check"])
    assert again.exit_code == 0, again.output
    assert f"The bucket {MISSING} exists." in again.output


def test_kiln_storage_check_refuses_another_scheme(
    kiln: CliRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_STORAGE_URL", "gs://somewhere/kiln")
    answer = kiln.invoke(app, ["storage", "check"])
    assert answer.exit_code == 1
    assert "KILN_STORAGE_URL must start with s3:// or file://" in flat(answer.output)
