"""Starting and reaching real services: a fresh Postgres database, a Redis DB index of our own,
moto's standalone S3 server, and real `kiln api` / `kiln worker` processes; the KILN_* settings
that point Kiln at them, and API keys.

Plain functions, no pytest: the integration fixtures (tests/stack.py) and the benchmark
(`bench/`) share them.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import psycopg
import redis

from kiln.app.core.config import Settings, get_settings
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.dispatch.producer import make_producer
from kiln.app.tenants.auth import create_key

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get("KILN_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ServiceUnavailableError(RuntimeError):
    """A service the run needs does not answer; the message says which and where."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(interval)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f} s")


class Process:
    """A subprocess whose output goes to a log file shown when something fails."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acknowledgements, as a crash or an OOM kill."""
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def kiln_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.app.cli", *args]


def create_database(admin_url: str = PG_ADMIN_URL, prefix: str = "kiln_test") -> str:
    """A new, empty database; returns its SQLAlchemy URL."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(admin_url, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as error:
        raise ServiceUnavailableError(
            f"PostgreSQL is not reachable at {admin_url}: {error}"
        ) from None
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")
    return f"{base}/{name}"


def drop_database(url: str, admin_url: str = PG_ADMIN_URL) -> None:
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


CLAIM_TTL_S = 3 * 3600  # a crashed run's claim expires rather than blocking the index forever


def claim_redis_db() -> str:
    """A Redis database index of our own, emptied first, so workers of other runs on this
    machine (other sessions, CI) can't steal our messages: indexes 1-15 are claimed with a
    SET NX key in index 0, so two concurrent runs never share one."""
    client = redis.Redis(REDIS_HOST, REDIS_PORT, db=0, socket_connect_timeout=3)
    try:
        for index in random.sample(range(1, 16), 15):
            if client.set(f"kiln-test:claim:{index}", os.getpid(), nx=True, ex=CLAIM_TTL_S):
                break
        else:
            raise ServiceUnavailableError("Every Redis database index 1-15 is claimed by a run.")
    except redis.ConnectionError as error:
        raise ServiceUnavailableError(
            f"Redis is not reachable at {REDIS_HOST}:{REDIS_PORT}: {error}"
        ) from None
    finally:
        client.close()
    with redis.Redis(REDIS_HOST, REDIS_PORT, db=index, socket_connect_timeout=3) as claimed:
        claimed.flushdb()
    return f"redis://{REDIS_HOST}:{REDIS_PORT}/{index}"


def release_redis_db(url: str) -> None:
    index = int(url.rsplit("/", 1)[1])
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()
    with redis.Redis(REDIS_HOST, REDIS_PORT, db=0) as admin:
        admin.delete(f"kiln-test:claim:{index}")


def start_moto(log_dir: Path) -> tuple[Process, str]:
    """moto's standalone S3 server on a free port of 127.0.0.1."""
    port = free_port()
    env = {**os.environ, **AWS_ENV}
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    server = Process("moto", args, env, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/moto-api/").status_code < 500, 30, "moto server")
    except TimeoutError:
        server.stop()
        raise
    return server, url


def use_moto_credentials() -> None:
    """Let boto3 in this process (a client, or Kiln run in-process) sign requests for moto."""
    for key, value in AWS_ENV.items():
        os.environ.setdefault(key, value)


def make_buckets(endpoint: str, *buckets: str) -> Any:
    """An S3 client of the server at `endpoint`, with `buckets` created there."""
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=AWS_ENV["AWS_DEFAULT_REGION"],
        aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    )
    for bucket in buckets:
        client.create_bucket(Bucket=bucket)
    return client


@dataclass(frozen=True)
class Services:
    """What Kiln runs on: a database, a broker, and an S3 endpoint with its client."""

    database_url: str
    broker_url: str
    s3_endpoint: str
    s3: Any
    moto: Process

    def kiln_env(self, data_dir: Path, storage_url: str, **settings: str) -> dict[str, str]:
        """`kiln_env` on these services."""
        return kiln_env(
            data_dir=data_dir,
            database_url=self.database_url,
            broker_url=self.broker_url,
            storage_url=storage_url,
            s3_endpoint=self.s3_endpoint,
            **settings,
        )


@contextmanager
def backing_services(log_dir: Path, buckets: Sequence[str], db_prefix: str) -> Iterator[Services]:
    """A fresh Postgres database, a Redis index of our own and moto holding `buckets`; the
    database dropped and the index released on exit."""
    use_moto_credentials()
    with ExitStack() as stack:
        database_url = create_database(prefix=db_prefix)
        stack.callback(drop_database, database_url)
        broker_url = claim_redis_db()
        stack.callback(release_redis_db, broker_url)
        moto, endpoint = start_moto(log_dir)
        stack.callback(moto.stop)
        yield Services(database_url, broker_url, endpoint, make_buckets(endpoint, *buckets), moto)


def kiln_env(
    *,
    data_dir: Path,
    database_url: str,
    broker_url: str,
    storage_url: str,
    s3_endpoint: str,
    **settings: str,
) -> dict[str, str]:
    """The KILN_* variables of a Kiln on these services; `settings` adds others by their
    field name (`chunk_size="8"` is KILN_CHUNK_SIZE)."""
    fields = {
        "data_dir": str(data_dir),
        "database_url": database_url,
        "broker_url": broker_url,
        "storage_url": storage_url,
        "s3_endpoint_url": s3_endpoint,
        **settings,
    }
    return {f"KILN_{name.upper()}": value for name, value in fields.items()}


def settings_for(env: Mapping[str, str]) -> Settings:
    """The Settings a process started with `env` would read (its KILN_* variables)."""
    return get_settings(
        **{k.removeprefix("KILN_").lower(): v for k, v in env.items() if k.startswith("KILN_")}
    )


def create_api_key(settings: Settings, tenant: str, buckets: Sequence[str] = ()) -> str:
    """A new API key of `tenant`, which may read `buckets`; returns its secret."""
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            return create_key(session, tenant, buckets).secret
    finally:
        engine.dispose()


def service_env(service_vars: dict[str, str]) -> dict[str, str]:
    """This process's environment without its own KILN_* settings, plus `service_vars`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    return {**env, **AWS_ENV, **service_vars}


def start_api(env: dict[str, str], log_dir: Path, name: str = "api") -> tuple[Process, str]:
    port = free_port()
    api = Process(name, kiln_command("api", "--port", str(port)), env, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/healthz").status_code == 200, 60, "kiln api")
    except TimeoutError:
        api.stop()
        raise
    return api, url


def start_worker(
    env: dict[str, str],
    log_dir: Path,
    *args: str,
    name: str = "worker",
    node_prefix: str = "test",
) -> tuple[Process, str]:
    """A `kiln worker` process (`args` added to its command line), returned once it answers
    a ping on the broker its `env` names; and its node name."""
    node = f"{node_prefix}-{secrets.token_hex(3)}@localhost"
    proc = Process(name, kiln_command("worker", "--hostname", node, *args), env, log_dir)
    producer = make_producer(settings_for(env))

    def answers() -> bool:
        return proc.alive() and bool(producer.control.ping([node], timeout=1.0))

    try:
        wait_for(answers, 60, "kiln worker", interval=0.5)
    except TimeoutError:
        proc.stop()
        raise
    finally:
        producer.close()
    return proc, node
