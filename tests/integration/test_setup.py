"""Setup that tells the truth, on the real stack (Postgres, Redis, moto's S3 server, real
`kiln` processes): the README's "As a service" steps run as written on fresh services;
`/readyz` and a submit name Kiln's missing bucket with a 503 until `kiln storage check
--create` makes it; `kiln db upgrade` says what it did."""

from __future__ import annotations

import re
import secrets
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.images import photo
from devstack.services import (
    AWS_ENV,
    Process,
    claim_redis_db,
    create_api_key,
    create_database,
    drop_database,
    free_port,
    kiln_command,
    kiln_env,
    release_redis_db,
    settings_for,
    start_api,
)
from devstack.services import service_env as process_env
from kiln.app.api.errors import SCHEMA_MISSING
from kiln.app.db import migrate
from tests.stack import RUNNING, run_kiln

ROOT = Path(__file__).resolve().parents[2]
DONE = {"completed", "failed", "cancelled"}


def flat(text: str) -> str:
    return " ".join(text.split())


def missing_sentence(bucket: str) -> str:
    return (
        f"Kiln's storage bucket {bucket} does not exist (KILN_STORAGE_URL); "
        "create it with `kiln storage check --create`."
    )


def upload(http: httpx.Client, name: str = "a.jpg") -> httpx.Response:
    return http.post("/v1/jobs", data={"model": "phash"}, files=[("files", (name, photo(1)))])


def wait_done(http: httpx.Client, job_id: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in DONE:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job}")


@pytest.fixture
def fresh_database(postgres_url: str) -> Iterator[str]:
    """A new, empty Postgres database (as `createdb kiln` makes), dropped afterwards."""
    url = create_database(prefix="kiln_setup")
    yield url
    drop_database(url)


@pytest.fixture
def processes() -> Iterator[list[Process]]:
    """Processes a test starts, stopped (and their logs kept for a failure) afterwards."""
    started: list[Process] = []
    yield started
    for proc in reversed(started):
        RUNNING.pop(proc.name, None)
        proc.stop()


def start(
    processes: list[Process], name: str, args: list[str], env: dict[str, str], logs: Path
) -> Process:
    proc = Process(name, kiln_command(*args), process_env(env), logs)
    processes.append(proc)
    RUNNING[name] = proc
    return proc


def test_a_missing_store_bucket_is_a_503_until_storage_check_creates_it(
    own_broker_env: dict[str, str], sessions: object, log_dir: Path, processes: list[Process]
) -> None:
    bucket = f"kiln-trial-{secrets.token_hex(3)}"
    env = {**own_broker_env, "KILN_STORAGE_URL": f"s3://{bucket}/kiln"}
    api, url = start_api(process_env(env), log_dir, name="api-no-bucket")
    processes.append(api)
    RUNNING[api.name] = api
    key = create_api_key(settings_for(env), "acme")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.json()["checks"] == {
            "database": "ok",
            "broker": "ok",
            "storage": missing_sentence(bucket),
        }
        refused = upload(http)
        assert refused.status_code == 503, refused.text  # the server's fault, never a 4xx
        assert refused.json() == {"detail": missing_sentence(bucket)}
        assert refused.headers["Retry-After"]

        checked = run_kiln(env, "storage", "check")
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert missing_sentence(bucket) in flat(checked.stderr)
        created = run_kiln(env, "storage", "check", "--create")
        assert created.returncode == 0, created.stdout + created.stderr
        assert f"Created the bucket {bucket}." in created.stdout
        assert "the store works." in created.stdout

        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}
        assert upload(http).status_code == 202


def test_db_upgrade_says_what_it_did_and_readyz_says_what_is_missing(
    fresh_database: str, service_env: dict[str, str], log_dir: Path, processes: list[Process]
) -> None:
    env = {**service_env, "KILN_DATABASE_URL": fresh_database}
    api, url = start_api(process_env(env), log_dir, name="api-fresh-db")
    processes.append(api)
    RUNNING[api.name] = api
    database = httpx.get(f"{url}/readyz").json()["checks"]["database"]
    assert database == "The database has no Kiln tables; run `kiln db upgrade`."
    # a request meanwhile meets the same fault: a 503 that says so, not an internal error
    early = httpx.post(
        f"{url}/v1/jobs", json={"model": "phash", "inputs": [{"uri": "s3://photos/cat.jpg"}]},
        headers={"Authorization": "Bearer kiln_not-checked-yet"},
    )  # fmt: skip
    assert early.status_code == 503, early.text
    assert early.json() == {"detail": SCHEMA_MISSING}

    head = migrate.describe(migrate.head())
    count = len(list(migrate.scripts().walk_revisions()))
    fresh = run_kiln(env, "db", "upgrade")
    assert fresh.returncode == 0, fresh.stderr
    assert flat(fresh.stdout) == (
        f"Upgraded the database at {fresh_database} from empty to {head}: "
        f"{count} migrations applied."
    )
    again = run_kiln(env, "db", "upgrade")
    assert again.returncode == 0, again.stderr
    assert (
        flat(again.stdout)
        == f"The database at {fresh_database} is already at {head}; nothing to do."
    )
    assert httpx.get(f"{url}/readyz").json()["checks"]["database"] == "ok"


def readme_service_block() -> list[str]:
    """The README's "As a service" commands, one per line, comments and all."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### As a service", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the README's 'As a service' section has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readmes_service_steps_run_as_written(
    fresh_database: str, s3_endpoint: str, tmp_path: Path, log_dir: Path, processes: list[Process]
) -> None:
    """Each `kiln` line runs as the README writes it (ports swapped for free ones), against a
    fresh database, a Redis index of our own and a bucket that does not exist yet; then a job
    is served end to end, and a bucket the user names that does not exist fails its item."""
    lines = readme_service_block()
    exported = {
        name for line in lines if line.startswith("export ") for name in re.findall(r"(\w+)=", line)
    }
    assert exported == {
        "KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORAGE_URL", "KILN_S3_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "KILN_API_KEY", "KILN_API_URL",
    }  # fmt: skip
    others = [line.split()[0] for line in lines if not line.startswith(("export ", "kiln "))]
    # pip: this test runs in the environment it made; createdb: `fresh_database`; curl: below
    assert others == ["pip", "createdb", "curl"]
    assert lines[0].startswith("pip install '.[cpu]'")
    # the CLI's variables are set before the first command that needs them (the API's start)
    first_api = next(i for i, line in enumerate(lines) if line.startswith("kiln api"))
    assert all(
        any(line.startswith(f"export {name}=") for line in lines[:first_api])
        for name in ("KILN_API_KEY", "KILN_API_URL")
    )

    broker = claim_redis_db()
    try:
        bucket = f"kiln-readme-{secrets.token_hex(3)}"
        env = {
            **kiln_env(
                data_dir=tmp_path / "data",
                database_url=fresh_database,
                broker_url=broker,
                storage_url=f"s3://{bucket}/kiln",
                s3_endpoint=s3_endpoint,
            ),
            **AWS_ENV,
        }
        api_port, metrics_port = str(free_port()), str(free_port())
        ports = {"8000": api_port, "9808": metrics_port}
        key = ""
        said: dict[str, str] = {}
        for line in lines:
            if given := re.match(r"export KILN_API_KEY=\$\((kiln [^)]*)\)", line):
                made = run_kiln(env, *shlex.split(given.group(1))[1:])
                assert made.returncode == 0, f"{line}\n{made.stderr}"
                key = env["KILN_API_KEY"] = made.stdout.strip()
                continue
            if given := re.match(r"export KILN_API_URL=(\S+)", line):
                env["KILN_API_URL"] = given.group(1).replace(":8000", f":{api_port}")
                continue
            if not line.startswith("kiln "):
                continue
            words = [ports.get(w, w) for w in shlex.split(line, comments=True)[1:]]
            if words[-1] == "&":
                start(processes, f"readme-{words[0]}", words[:-1], env, log_dir)
                continue
            done = run_kiln(env, *words)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            said[" ".join(words[:2])] = flat(done.stdout)

        assert said["db upgrade"].startswith(
            f"Upgraded the database at {fresh_database} from empty"
        )
        assert f"Created the bucket {bucket}." in said["storage check"]
        assert {"readme-api", "readme-worker", "readme-beat"} <= {p.name for p in processes}

        url = f"http://127.0.0.1:{api_port}"
        deadline = time.monotonic() + 60
        while True:  # curl --retry --retry-connrefused …/healthz; curl …/readyz
            try:
                ready = httpx.get(f"{url}/readyz")
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "kiln api did not answer"
                time.sleep(0.5)
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"database": "ok", "broker": "ok", "storage": "ok"}

        assert re.fullmatch(r"kiln_[0-9a-f]{8}_\S+", key), key  # stdout is the key alone
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as http:
            job = upload(http).json()
            assert wait_done(http, job["id"])["counts"]["succeeded"] == 1
            # the CLI finds the API and the key where the block set them
            status = run_kiln(env, "status", job["id"][:8])
            assert status.returncode == 0, status.stderr
            assert flat(status.stdout).startswith(f"job {job['id']} completed: 1 succeeded")
            # acme may read s3://photos (the README's --bucket), but no such bucket exists:
            # the user's error, on its item, not the server's 503
            named = http.post(
                "/v1/jobs", json={"model": "phash", "inputs": [{"uri": "s3://photos/cat.jpg"}]}
            )
            assert named.status_code == 202, named.text
            assert wait_done(http, named.json()["id"])["counts"]["failed"] == 1
            items = http.get(f"/v1/jobs/{named.json()['id']}/items").json()["items"]
            assert items[0]["error"] == "The bucket of s3://photos/cat.jpg does not exist."
        assert all(p.alive() for p in processes), [p.name for p in processes if not p.alive()]
    finally:
        for proc in reversed(processes):
            proc.stop()
        release_redis_db(broker)
