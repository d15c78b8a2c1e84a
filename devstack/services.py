"""Starting and reaching real services: a fresh Postgres database, a Redis DB index of our own,
moto's standalone S3 server, and real `kiln api` / `kiln worker` processes.

Plain functions, no pytest: the integration fixtures and the benchmark (`bench/`) share them.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import redis

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
    ping: Callable[[str], bool],
    *args: str,
    name: str = "worker",
    node_prefix: str = "test",
) -> tuple[Process, str]:
    """A `kiln worker` process; `ping(node)` says when it answers on the broker."""
    node = f"{node_prefix}-{secrets.token_hex(3)}@localhost"
    proc = Process(name, kiln_command("worker", "--hostname", node, *args), env, log_dir)
    try:
        wait_for(lambda: proc.alive() and ping(node), 60, "kiln worker", interval=0.5)
    except TimeoutError:
        proc.stop()
        raise
    return proc, node
