"""The dev stack's pure parts (devstack/services.py): the KILN_* settings of a Kiln on given
services, read back as the process started with them would. The launchers themselves run in
tests/integration and the benchmark's smoke test."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.services import AWS_ENV, Services, kiln_env, service_env, settings_for

SERVICES = {
    "database_url": "postgresql+psycopg://postgres@127.0.0.1:5432/kiln_test_1",
    "broker_url": "redis://127.0.0.1:6379/7",
    "s3_endpoint": "http://127.0.0.1:5000",
}


def test_kiln_env_names_each_setting_as_kiln_reads_it(tmp_path: Path) -> None:
    env = kiln_env(data_dir=tmp_path, storage_url="s3://b/run", chunk_size="8", **SERVICES)
    assert env == {
        "KILN_DATA_DIR": str(tmp_path),
        "KILN_DATABASE_URL": SERVICES["database_url"],
        "KILN_BROKER_URL": SERVICES["broker_url"],
        "KILN_STORAGE_URL": "s3://b/run",
        "KILN_S3_ENDPOINT_URL": SERVICES["s3_endpoint"],
        "KILN_CHUNK_SIZE": "8",
    }


def test_the_settings_a_process_would_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CHUNK_SIZE", "999")  # this process's own: the env given wins
    env = service_env(
        kiln_env(data_dir=tmp_path, storage_url="s3://b/run", chunk_size="8", **SERVICES)
    )
    settings = settings_for(env)
    assert settings.database_url == SERVICES["database_url"]
    assert settings.broker_url == SERVICES["broker_url"]
    assert settings.s3_endpoint_url == SERVICES["s3_endpoint"]
    assert settings.chunk_size == 8
    assert {k: env[k] for k in AWS_ENV} == AWS_ENV  # boto3 in the process signs for moto


def test_services_fill_in_their_own_urls(tmp_path: Path) -> None:
    backing = Services(s3=None, moto=None, **SERVICES)  # type: ignore[arg-type]
    assert backing.kiln_env(tmp_path, "s3://b/run", max_batch="4") == kiln_env(
        data_dir=tmp_path, storage_url="s3://b/run", max_batch="4", **SERVICES
    )
