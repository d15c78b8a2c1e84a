"""`kiln flower` as a real process against the test Redis: never open, basic auth or Flower's
own OAuth, and it sees the running Kiln worker."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from devstack.services import Process, free_port, kiln_command, wait_for
from devstack.services import service_env as _env
from tests.stack import run_kiln

OAUTH = {
    "FLOWER_AUTH_PROVIDER": "flower.views.auth.GithubLoginHandler",
    "FLOWER_AUTH": r".*@example\.com",
    "FLOWER_OAUTH2_KEY": "kiln-test-client",
    "FLOWER_OAUTH2_SECRET": "kiln-test-secret",
}


@contextmanager
def flower(env: dict[str, str], log_dir: Path, name: str = "flower") -> Iterator[str]:
    port = free_port()
    proc = Process(name, kiln_command("flower", "--port", str(port)), _env(env), log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/healthcheck").status_code == 200, 60, "flower")
        yield url
    finally:
        proc.stop()


def node_of(worker: Process) -> str:
    args = list(worker.proc.args)  # type: ignore[arg-type]
    return str(args[args.index("--hostname") + 1])


def test_flower_never_runs_open(service_env: dict[str, str]) -> None:
    refused = run_kiln({**service_env, "KILN_FLOWER_BASIC_AUTH": ""}, "flower", timeout=60)
    assert refused.returncode != 0
    assert "Flower never runs open." in refused.stderr
    assert "KILN_FLOWER_BASIC_AUTH=user:password" in refused.stderr
    # Half of Flower's OAuth settings is not a login either.
    partial = {**service_env, "FLOWER_AUTH_PROVIDER": OAUTH["FLOWER_AUTH_PROVIDER"]}
    refused = run_kiln(partial, "flower", timeout=60)
    assert refused.returncode != 0 and "FLOWER_OAUTH2_SECRET" in refused.stderr


def test_flower_asks_for_basic_auth_and_lists_the_worker(
    service_env: dict[str, str], worker: Process, log_dir: Path
) -> None:
    node = node_of(worker)
    with flower({**service_env, "KILN_FLOWER_BASIC_AUTH": "ops:s3cret"}, log_dir) as url:
        assert httpx.get(url + "/api/workers").status_code == 401
        wrong = httpx.get(url + "/api/workers", auth=("ops", "guess"))
        assert wrong.status_code == 401

        def lists_worker() -> bool:
            answer = httpx.get(url + "/api/workers", auth=("ops", "s3cret"), params={"refresh": 1})
            return answer.status_code == 200 and node in answer.json()

        wait_for(lists_worker, 30, f"{node} in flower's /api/workers", interval=1)


def test_flower_starts_with_its_own_oauth(service_env: dict[str, str], log_dir: Path) -> None:
    env = {**service_env, "KILN_FLOWER_BASIC_AUTH": "", **OAUTH}
    with flower(env, log_dir, name="flower-oauth") as url:
        api = httpx.get(url + "/api/workers")
        assert api.status_code == 302 and api.headers["location"].startswith("/login")
        login = httpx.get(url + "/login")
        assert login.status_code == 302
        assert login.headers["location"].startswith("https://github.com/login/oauth/authorize")
        assert "client_id=kiln-test-client" in login.headers["location"]
