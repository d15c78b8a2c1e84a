"""`get_settings`: embedded defaults under the data dir, `KILN_*` overrides, validation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.app.core.config import Settings, get_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No `KILN_*` variable from the host leaks in; the data dir is a fresh folder."""
    for name in list(os.environ):
        if name.upper().startswith("KILN_"):
            monkeypatch.delenv(name)
    data_dir = tmp_path / "data"
    monkeypatch.setenv("KILN_DATA_DIR", str(data_dir))
    return data_dir


def test_embedded_defaults_live_under_the_data_dir(clean_env: Path) -> None:
    settings = get_settings()
    data_dir = clean_env.resolve()
    assert isinstance(settings, Settings)
    assert settings.data_dir == data_dir
    assert settings.database_url == f"sqlite:///{data_dir / 'kiln.db'}"
    assert settings.database_url.startswith("sqlite:////")  # absolute path: four slashes
    assert settings.broker_url.startswith("filesystem:")
    assert settings.embedded_broker is True
    assert settings.storage_url == (data_dir / "objects").as_uri()
    assert settings.storage_url.startswith("file:///")
    assert settings.model_cache_dir == data_dir / "models"
    assert settings.broker_dir == data_dir / "broker"


def test_plain_defaults() -> None:
    settings = get_settings()
    assert settings.max_batch == "auto"  # a sweep on a GPU, 16 on a CPU
    assert settings.batch_cap(on_gpu=False) == 16 and settings.batch_cap(on_gpu=True) == 256
    assert settings.prep_processes == "auto" and settings.prep_count(cores=16) == 16
    assert settings.bulk_chunk_size == 512
    assert settings.max_delay_ms == 10.0
    assert settings.max_delay_s == pytest.approx(0.01)
    assert settings.runners == 0  # auto: one per core on CPU, one on a GPU
    assert settings.s3_endpoint_url is None
    assert settings.api_key is None


def test_relative_data_dir_is_resolved(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KILN_DATA_DIR", "state")
    settings = get_settings()
    assert settings.data_dir == (tmp_path / "state").resolve()
    assert settings.data_dir.is_absolute()
    assert settings.database_url == f"sqlite:///{(tmp_path / 'state').resolve() / 'kiln.db'}"


def test_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_MAX_BATCH", "64")
    monkeypatch.setenv("KILN_MAX_DELAY_MS", "2.5")
    monkeypatch.setenv("KILN_RUNNERS", "3")
    monkeypatch.setenv("KILN_BROKER_URL", "redis://localhost:6379/0")
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://kiln@db/kiln")
    monkeypatch.setenv("KILN_STORAGE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("KILN_S3_ENDPOINT_URL", "http://minio:9000")
    settings = get_settings()
    assert settings.max_batch == 64
    assert settings.max_delay_s == pytest.approx(0.0025)
    assert settings.runners == 3
    assert settings.broker_url == "redis://localhost:6379/0"
    assert settings.embedded_broker is False
    assert settings.database_url == "postgresql+psycopg://kiln@db/kiln"
    assert settings.storage_url == "s3://bucket/prefix"
    assert settings.s3_endpoint_url == "http://minio:9000"


def test_variables_without_the_prefix_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_BATCH", "99")
    assert get_settings().max_batch == "auto"


def test_explicit_overrides_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_MAX_BATCH", "64")
    assert get_settings(max_batch=8).max_batch == 8


def test_each_call_reads_the_environment_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_settings().max_batch == "auto"
    monkeypatch.setenv("KILN_MAX_BATCH", "32")
    assert get_settings().max_batch == 32


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KILN_MAX_BATCH", "0"),
        ("KILN_MAX_BATCH", "5000"),
        ("KILN_MAX_BATCH", "many"),
        ("KILN_RUNNERS", "-1"),
        ("KILN_MAX_DELAY_MS", "-1"),
        ("KILN_CHUNK_SIZE", "0"),
        ("KILN_FILESYSTEM_POLLING_MS", "0"),
    ],
)
def test_invalid_values_raise(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    field = name.removeprefix("KILN_").lower()
    with pytest.raises(ValidationError, match=field):
        get_settings()


@pytest.mark.parametrize(
    ("broker_url", "embedded"),
    [
        ("filesystem://localhost/", True),
        ("filesystem:", True),
        ("redis://localhost:6379/0", False),
        ("memory://", False),
    ],
)
def test_embedded_broker(broker_url: str, embedded: bool) -> None:
    assert get_settings(broker_url=broker_url).embedded_broker is embedded


@pytest.mark.parametrize(
    ("overrides", "threads"),
    [
        ({}, 16),  # auto: four batches of 256 are two bulk chunks of 512; one-image jobs want 16
        ({"max_batch": 2}, 16),
        ({"max_batch": 4096}, 33),  # ceil(4 × 4096 / 512) + 1
        ({"max_batch": 1024, "bulk_chunk_size": 64}, 65),
        ({"worker_concurrency": 5}, 5),
    ],
)
def test_task_threads_count_chunks_in_flight_not_rows(overrides: dict, threads: int) -> None:
    assert get_settings(**overrides).task_threads == threads


@pytest.mark.parametrize("value", ["0", "-1", "4097", "many"])
def test_a_bad_max_batch_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KILN_MAX_BATCH", value)
    with pytest.raises(ValidationError):
        get_settings()


def test_prep_processes_zero_means_on_the_chunk_thread() -> None:
    assert get_settings(prep_processes=0).prep_count(cores=8) == 0
    assert get_settings(prep_processes=3).prep_count(cores=8) == 3


def test_gpu_decode_auto_is_the_gpu() -> None:
    """Measured on an H200 (issue 24): nvJPEG with the batched fit beat 16 prep processes."""
    assert get_settings().decode_on_gpu() and get_settings(gpu_decode=True).decode_on_gpu()
    assert not get_settings(gpu_decode=False).decode_on_gpu()


def test_embedded_ignores_the_service_and_keeps_the_rest(
    monkeypatch: pytest.MonkeyPatch, clean_env: Path
) -> None:
    """`kiln run`'s settings: the embedded stack under the data dir whatever the service
    variables say; every other setting as given."""
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://kiln@db/kiln")
    monkeypatch.setenv("KILN_BROKER_URL", "redis://localhost:6379/0")
    monkeypatch.setenv("KILN_STORAGE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("KILN_CHUNK_SIZE", "7")
    service = get_settings()
    here = service.embedded()
    plain = get_settings(database_url="", broker_url="", storage_url="")
    assert (here.database_url, here.broker_url, here.storage_url) == (
        plain.database_url,
        plain.broker_url,
        plain.storage_url,
    )
    assert here.database_url == f"sqlite:///{clean_env.resolve() / 'kiln.db'}"
    assert here.embedded_broker and here.storage_url.startswith("file:///")
    assert here.chunk_size == 7 and here.data_dir == service.data_dir
    assert service.database_url.startswith("postgresql")  # the original is left as it was
    assert here.embedded() == here
