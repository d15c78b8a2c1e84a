"""Real services for integration and reliability tests: a fresh Postgres database, a Redis DB
index of our own, moto's standalone S3 server, and real `kiln api` / `kiln worker` processes.

A plugin (tests/conftest.py), so tests/integration and tests/reliability share one stack."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from devstack.services import (
    AWS_ENV,
    IN_CI,
    Process,
    ServiceUnavailableError,
    claim_redis_db,
    create_database,
    drop_database,
    free_port,
    kiln_command,
    kiln_env,
    make_buckets,
    release_redis_db,
    settings_for,
    start_api,
    start_moto,
    start_worker,
)
from devstack.services import (
    service_env as _env,
)
from kiln.app.core.config import Settings
from kiln.app.db.migrate import upgrade
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.tenants.auth import create_key
from kiln.app.tenants.tenants import allow_bucket

BUCKET = "kiln-test"
WEBHOOK_SECRET = "integration-webhook-secret-0123456789"
SOURCE_BUCKET = "kiln-sources"

RUNNING: dict[str, Process] = {}  # long-lived processes whose logs explain a failure


def unavailable(reason: str) -> NoReturn:
    """In CI a missing service fails the run; on a laptop it skips with the reason."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: services are required)", pytrace=False)
    pytest.skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if report.failed:
        for name, proc in RUNNING.items():
            report.sections.append((f"{name} log (last lines)", proc.log_tail()))
    return report


STACK_DIRS = tuple(Path(__file__).parent / d for d in ("integration", "reliability", "browser"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(folder in Path(str(item.fspath)).parents for folder in STACK_DIRS):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    try:
        url = create_database()
    except ServiceUnavailableError as error:
        unavailable(str(error))
    yield url
    drop_database(url)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    try:
        url = claim_redis_db()
    except ServiceUnavailableError as error:
        unavailable(str(error))
    yield url
    release_redis_db(url)


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def s3_endpoint(log_dir: Path) -> Iterator[str]:
    server, url = start_moto(log_dir)
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3(s3_endpoint: str, monkeypatch_session: pytest.MonkeyPatch) -> object:
    return make_buckets(s3_endpoint, BUCKET, SOURCE_BUCKET)


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
    kiln = kiln_env(
        data_dir=tmp_path_factory.mktemp("kiln-data"),
        database_url=postgres_url,
        broker_url=redis_url,
        storage_url=f"s3://{BUCKET}/run-{secrets.token_hex(3)}",
        s3_endpoint=s3_endpoint,
        chunk_size="8",
        bulk_chunk_size="8",  # so a test's few hundred items make several chunks
        max_batch="8",
        max_delay_ms="20",
        worker_concurrency="4",
    )
    return {**kiln, **AWS_ENV}


@pytest.fixture(scope="session")
def settings(service_env: dict[str, str]) -> Settings:
    return settings_for(service_env)


@pytest.fixture
def own_broker_env(service_env: dict[str, str], migrated: Settings) -> Iterator[dict[str, str]]:
    """The session's environment with a Redis database of this test's own, so the session's
    worker can neither help nor steal from the processes the test starts."""
    broker = claim_redis_db()
    try:
        yield {**service_env, "KILN_BROKER_URL": broker}
    finally:
        release_redis_db(broker)


@pytest.fixture(scope="session")
def migrated(settings: Settings) -> Settings:
    upgrade(settings)
    return settings


@pytest.fixture(scope="session")
def sessions(migrated: Settings) -> Iterator[object]:
    engine = make_engine(migrated.database_url)
    factory = make_session_factory(engine)
    allow_test_buckets(factory, "acme")  # tests that submit as `acme` without an HTTP client
    yield factory
    engine.dispose()


def allow_test_buckets(sessions: object, tenant: str) -> None:
    """Let `tenant` read the stack's buckets (an empty allow-list means no S3 at all)."""
    with sessions() as session:  # type: ignore[operator]
        for bucket in (BUCKET, SOURCE_BUCKET):
            allow_bucket(session, tenant, bucket)
        session.commit()


@pytest.fixture(scope="session")
def api_url(migrated: Settings, service_env: dict[str, str], log_dir: Path) -> Iterator[str]:
    api, url = start_api(_env(service_env), log_dir)
    RUNNING["api"] = api
    try:
        yield url
    finally:
        RUNNING.pop("api")
        api.stop()


@pytest.fixture(scope="session")
def worker_metrics_url() -> str:
    """Where the session `worker` serves its Prometheus metrics."""
    return f"http://127.0.0.1:{free_port()}/metrics"


@pytest.fixture(scope="session")
def worker(
    migrated: Settings, service_env: dict[str, str], log_dir: Path, worker_metrics_url: str
) -> Iterator[Process]:
    port = worker_metrics_url.rsplit(":", 1)[1].split("/")[0]
    env = {**_env(service_env), "KILN_WORKER_METRICS_PORT": port}  # this worker only
    proc, _node = start_worker(env, log_dir)
    RUNNING["worker"] = proc
    try:
        yield proc
    finally:
        RUNNING.pop("worker")
        proc.stop()


def _key(sessions: object, tenant: str) -> str:
    """A new API key of `tenant`, which may read the stack's buckets."""
    with sessions() as session:  # type: ignore[operator]
        return create_key(session, tenant, (BUCKET, SOURCE_BUCKET)).secret


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


@dataclass(frozen=True)
class WebhookStack:
    """An API and a worker that sign and send webhooks; `key(tenant)` makes an API key."""

    url: str
    sessions: sessionmaker[Session]

    def key(self, tenant: str) -> str:
        return _key(self.sessions, tenant)


@pytest.fixture(scope="session")
def webhook_stack(service_env: dict[str, str], log_dir: Path, s3: object) -> Iterator[WebhookStack]:
    """`kiln api` + `kiln worker` with KILN_WEBHOOK_SECRET set and loopback receivers allowed
    (a test's receiver is on 127.0.0.1), retrying a failed delivery within seconds. On a
    database and a Redis index of their own: the session's worker, which cannot sign, would
    otherwise claim their due deliveries too (any worker's courier claims any due row)."""
    with ExitStack() as cleanup:  # whatever was made is undone, also when a later step fails
        try:
            database = create_database()
            cleanup.callback(drop_database, database)
            broker = claim_redis_db()
            cleanup.callback(release_redis_db, broker)
        except ServiceUnavailableError as error:
            unavailable(str(error))
        env = {
            **service_env,
            "KILN_DATABASE_URL": database,
            "KILN_BROKER_URL": broker,
            "KILN_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "KILN_WEBHOOK_ALLOW_PRIVATE": "true",
            "KILN_WEBHOOK_BACKOFF_S": "1,1,2",
            "KILN_WEBHOOK_SWEEP_S": "1",
        }
        upgrade(settings_for(env))
        engine = make_engine(database)
        cleanup.callback(engine.dispose)
        api, url = start_api(_env(env), log_dir, name="api-webhooks")
        cleanup.callback(api.stop)
        worker, _node = start_worker(_env(env), log_dir, name="worker-webhooks")
        cleanup.callback(worker.stop)
        RUNNING.update({"api-webhooks": api, "worker-webhooks": worker})  # their logs, on a failure
        cleanup.callback(RUNNING.pop, "api-webhooks")
        cleanup.callback(RUNNING.pop, "worker-webhooks")
        yield WebhookStack(url, make_session_factory(engine))


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
