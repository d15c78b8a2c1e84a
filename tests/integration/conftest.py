"""Real services for integration tests: a fresh Postgres database, a Redis DB index of our
own, moto's standalone S3 server, and real `kiln api` / `kiln worker` processes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import psycopg
import pytest
import redis

from app.auth import create_key
from app.core.config import Settings, get_settings
from app.db.migrate import upgrade
from app.db.session import make_engine, make_session_factory
from tests.integration.services import (
    PG_ADMIN_URL,
    REDIS_HOST,
    REDIS_PORT,
    Process,
    free_port,
    kiln_command,
    unavailable,
    wait_for,
)

pytestmark = pytest.mark.integration

BUCKET = "kiln-test"
SOURCE_BUCKET = "kiln-sources"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


RUNNING: dict[str, Process] = {}  # long-lived processes whose logs explain a failure


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if report.failed:
        for name, proc in RUNNING.items():
            report.sections.append((f"{name} log (last lines)", proc.log_tail()))
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    name = f"kiln_test_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as error:
        unavailable(f"PostgreSQL is not reachable at {PG_ADMIN_URL}: {error}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    yield f"{base}/{name}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    # A database index of our own, emptied first, so stray workers of other runs can't steal.
    index = 1 + secrets.randbelow(15)
    client = redis.Redis(REDIS_HOST, REDIS_PORT, db=index, socket_connect_timeout=3)
    try:
        client.flushdb()
    except redis.ConnectionError as error:
        unavailable(f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}: {error}")
    yield f"redis://{REDIS_HOST}:{REDIS_PORT}/{index}"
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def s3_endpoint(log_dir: Path) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, **AWS_ENV}
    server = Process(
        "moto",
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env,
        log_dir,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/moto-api/").status_code < 500, 30, "moto server")
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(s3_endpoint: str, monkeypatch_session: pytest.MonkeyPatch) -> object:
    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    for bucket in (BUCKET, SOURCE_BUCKET):
        client.create_bucket(Bucket=bucket)
    return client


@pytest.fixture(scope="session")
def monkeypatch_session() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in AWS_ENV.items():
            patch.setenv(key, value)
        yield patch


@pytest.fixture(scope="session")
def service_env(
    postgres_url: str,
    redis_url: str,
    s3_endpoint: str,
    s3: object,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """The KILN_* environment every process of this test session shares."""
    data_dir = tmp_path_factory.mktemp("kiln-data")
    return {
        "KILN_DATA_DIR": str(data_dir),
        "KILN_DATABASE_URL": postgres_url,
        "KILN_BROKER_URL": redis_url,
        "KILN_STORAGE_URL": f"s3://{BUCKET}/run-{secrets.token_hex(3)}",
        "KILN_S3_ENDPOINT_URL": s3_endpoint,
        "KILN_CHUNK_SIZE": "8",
        "KILN_MAX_BATCH": "8",
        "KILN_MAX_DELAY_MS": "20",
        "KILN_WORKER_CONCURRENCY": "4",
        **AWS_ENV,
    }


@pytest.fixture(scope="session")
def settings(service_env: dict[str, str]) -> Settings:
    fields = {
        k.removeprefix("KILN_").lower(): v for k, v in service_env.items() if k.startswith("KILN_")
    }
    return get_settings(**fields)


@pytest.fixture(scope="session")
def migrated(settings: Settings) -> Settings:
    upgrade(settings)
    return settings


@pytest.fixture(scope="session")
def sessions(migrated: Settings) -> Iterator[object]:
    engine = make_engine(migrated.database_url)
    yield make_session_factory(engine)
    engine.dispose()


def _env(service_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, **service_env}


@pytest.fixture(scope="session")
def api_url(migrated: Settings, service_env: dict[str, str], log_dir: Path) -> Iterator[str]:
    port = free_port()
    api = Process("api", kiln_command("api", "--port", str(port)), _env(service_env), log_dir)
    url = f"http://127.0.0.1:{port}"
    RUNNING["api"] = api
    try:
        wait_for(lambda: httpx.get(url + "/healthz").status_code == 200, 60, "kiln api")
        yield url
    finally:
        RUNNING.pop("api")
        api.stop()


@pytest.fixture(scope="session")
def worker(migrated: Settings, service_env: dict[str, str], log_dir: Path) -> Iterator[Process]:
    node = f"test-{secrets.token_hex(3)}@localhost"
    proc = Process("worker", kiln_command("worker", "--hostname", node), _env(service_env), log_dir)
    from workers.celery_app import make_celery

    celery = make_celery(migrated)
    RUNNING["worker"] = proc
    try:
        wait_for(
            lambda: proc.alive() and bool(celery.control.ping([node], timeout=1.0)),
            60,
            "kiln worker",
            interval=0.5,
        )
        yield proc
    finally:
        RUNNING.pop("worker")
        celery.close()
        proc.stop()


def _key(sessions: object, tenant: str) -> str:
    with sessions() as session:  # type: ignore[operator]
        key = create_key(session, tenant)
        session.commit()
    return key.secret


@pytest.fixture(scope="session")
def client(api_url: str, worker: Process, sessions: object) -> Iterator[httpx.Client]:
    """An HTTP client for tenant `acme`, with a worker running."""
    headers = {"Authorization": f"Bearer {_key(sessions, 'acme')}"}
    with httpx.Client(base_url=api_url, headers=headers, timeout=60) as http:
        yield http


@pytest.fixture(scope="session")
def other_client(api_url: str, sessions: object) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {_key(sessions, 'globex')}"}
    with httpx.Client(base_url=api_url, headers=headers, timeout=60) as http:
        yield http


def run_kiln(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        kiln_command(*args),
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
