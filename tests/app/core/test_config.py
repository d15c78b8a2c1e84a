"""`get_settings`: embedded defaults under the data dir, `KILN_*` overrides, validation."""

from __future__ import annotations

import os
import re
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
    """auto: the GPU wherever nvJPEG is there (why: docs/gpu.md)."""
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


# Every variable as issue 31 found it (before the settings were grouped): its name (KILN_ + the
# field's name) and its default. Grouping must not rename, drop or re-default one.
DEFAULTS: dict[str, object] = {
    "data_dir": Path(".kiln"), "database_url": "", "broker_url": "", "storage_url": "",
    "s3_endpoint_url": None, "s3_region": "us-east-1", "db_pool_size": 10,
    "db_max_overflow": 20, "db_pool_timeout_s": 30.0, "model_cache_dir": None,
    "api_url": "http://127.0.0.1:8000", "api_key": None,
    "max_batch": "auto", "max_delay_ms": 10.0, "runners": 0, "engine_threads": 0,
    "engine": "auto", "engine_retry_s": 600.0, "batch_deadline_s": 300.0, "batch_deadlines": {},
    "device_memory_budget": "0.8", "model_idle_s": 600.0, "oom_recovery_s": 300.0,
    "gpu_decode": "auto", "jpeg_decoder": "auto", "device_pipeline": "staged",
    "decode_threads": 2, "precision": "auto", "cuda_graphs": True,
    "device_standin": None, "device_standin_report": None,
    "chunk_size": 32, "bulk_chunk_size": 512, "prep_processes": "auto", "run_max_s": 3600.0,
    "worker_concurrency": 0, "worker_metrics_port": None,
    "ingest_page_size": 1000, "ingest_pages_per_step": 20, "bulk_max_chunks": 64,
    "estimate_max_objects": 100_000, "estimate_budget_s": 20.0, "estimate_video_samples": 20,
    "estimate_header_bytes": 4 * 1024**2,
    "fair_share": True, "fair_share_window_per_slot": 2,
    "ingest_stale_s": 60.0, "visibility_timeout_s": 3600.0, "reconcile_interval_s": 15.0,
    "lease_s": 60.0, "lease_renew_s": 3.0, "cancel_check_s": 1.0, "redispatch_after_s": 60.0,
    "max_attempts": 20, "schedule_tick_s": 20.0, "filesystem_polling_ms": 20.0,
    "retention": None, "retention_max": None, "retention_sweep_rows": 20_000,
    "webhook_secret": None, "webhook_allow_private": False, "webhook_timeout_s": 10.0,
    "webhook_backoff_s": [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0],
    "webhook_concurrency": 16, "webhook_lease_s": 60.0, "webhook_sweep_s": 10.0,
    "max_upload_bytes": 50 * 1024**2, "max_video_frames": 100_000,
    "max_video_duration_s": 86_400.0, "max_files_per_job": 1000, "max_model_bytes": 1024**3,
    "max_image_pixels": 50_000_000, "local_inputs": False,
    "content_cache": True, "content_cache_shared": False, "content_cache_ttl_s": 604_800.0,
    "content_cache_max_entries": 1_000_000, "search_cache_bytes": 512 * 1024**2,
    "tenant_rate_limit": "100/second", "tenant_max_open_jobs": 1000, "search_wait_s": 30.0,
    "console_secret": None, "console_secure_cookie": False,
    "log_format": "auto", "log_level": None, "otlp_endpoint": None,
}  # fmt: skip


def test_every_variable_keeps_its_name_and_default() -> None:
    fields = Settings.model_fields
    assert set(fields) == set(DEFAULTS)
    assert Settings.model_config.get("env_prefix") == "KILN_"
    for name, field in fields.items():
        assert field.alias is None and field.validation_alias is None, name  # KILN_<NAME>
        assert field.get_default(call_default_factory=True) == DEFAULTS[name], name


def test_every_group_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """One variable of each group of `Settings`, read through the one `KILN_` prefix."""
    given = {
        "KILN_S3_REGION": "eu-west-1",
        "KILN_CUDA_GRAPHS": "false",
        "KILN_CHUNK_SIZE": "7",
        "KILN_LEASE_S": "9",
        "KILN_MAX_FILES_PER_JOB": "3",
        "KILN_CONTENT_CACHE_SHARED": "true",
        "KILN_SEARCH_WAIT_S": "4",
        "KILN_LOG_FORMAT": "json",
    }
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    s = get_settings()
    assert (s.s3_region, s.cuda_graphs, s.chunk_size, s.lease_s) == ("eu-west-1", False, 7, 9.0)
    assert (s.max_files_per_job, s.content_cache_shared, s.search_wait_s) == (3, True, 4.0)
    assert s.log_format == "json"


def test_a_short_console_secret_is_refused() -> None:
    with pytest.raises(ValidationError, match="at least 32 characters"):
        get_settings(console_secret="short")


def test_every_variable_in_the_readme_table_is_a_setting() -> None:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    table = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`KILN_([A-Z0-9_]+)`", table))
    assert named and {n.lower() for n in named} <= set(Settings.model_fields)
