"""A worker killed mid-job on the real stack: the job says it is stalled (`stalled_since`)
instead of looking busy, with what runs and what waits counted apart, until `kiln beat`'s
reconciler gives the dead worker's items to another worker, which finishes the job."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devstack.images import photo
from devstack.services import (
    Process,
    claim_redis_db,
    kiln_command,
    release_redis_db,
    start_api,
    start_worker,
)
from devstack.services import service_env as process_env
from kiln.app.tenants.auth import create_key
from tests.stack import RUNNING

LEASE_S = 12  # short, so the test sees the recovery; stalled after 10 s unrenewed (stale_s)


@pytest.fixture
def stack(
    service_env: dict[str, str], migrated: Any, sessions: Any, log_dir: Path
) -> Iterator[tuple[httpx.Client, Callable[[str], Process], dict[str, str]]]:
    broker = claim_redis_db()
    env = process_env(
        {
            **{k: v for k, v in service_env.items() if k.startswith("KILN_")},
            "KILN_BROKER_URL": broker,
            "KILN_LEASE_S": str(LEASE_S),
            "KILN_LEASE_RENEW_S": "2",
            "KILN_RECONCILE_INTERVAL_S": "2",
            "KILN_REDISPATCH_AFTER_S": "5",
        }
    )
    started: list[Process] = []

    def start(what: str) -> Process:
        if what == "beat":
            proc = Process("stall-beat", kiln_command("beat"), env, log_dir)
        else:
            proc, _node = start_worker(env, log_dir, name=what, node_prefix=what)
        started.append(proc)
        RUNNING[proc.name] = proc
        return proc

    try:
        api, url = start_api(env, log_dir, name="stall-api")
        started.append(api)
        with sessions() as session:
            key = create_key(session, "acme").secret
            session.commit()
        headers = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            yield http, start, env
    finally:
        for proc in started:
            RUNNING.pop(proc.name, None)
            proc.stop()
        release_redis_db(broker)


def test_a_dead_workers_job_says_it_is_stalled_until_another_takes_over(
    stack: tuple[httpx.Client, Callable[[str], Process], dict[str, str]],
) -> None:
    client, start, _env = stack
    first = start("stall-worker-a")
    files = [
        ("files", (f"s-{i:03d}.jpg", photo(900 + i, (96, 72)), "image/jpeg")) for i in range(64)
    ]
    job_id = client.post("/v1/jobs", data={"model": "ocr"}, files=files).json()["id"]

    job = _poll(
        client, job_id, lambda j: j["counts"]["running"] > 0 and j["counts"]["succeeded"] > 0
    )
    assert job["stalled_since"] is None  # busy, and renewing
    c = job["counts"]
    assert c["running"] + c["pending"] + c["succeeded"] + c["failed"] == c["total"]
    assert job["items_per_second"] > 0

    first.kill()  # SIGKILL: its leases are never renewed again, nor released
    killed_at = time.monotonic()
    stalled = _poll(client, job_id, lambda j: j["stalled_since"] is not None, timeout=30)
    assert time.monotonic() - killed_at < 20  # stale after 10 s unrenewed
    assert stalled["status"] == "running" and stalled["counts"]["running"] > 0

    start("stall-worker-b")
    start("beat")  # its reconciler re-sends the dead worker's chunks once their lease runs out
    recovered = _poll(client, job_id, lambda j: j["stalled_since"] is None, timeout=LEASE_S + 40)
    assert recovered["status"] in ("running", "completed")
    done = _poll(client, job_id, lambda j: j["status"] == "completed", timeout=300)
    assert done["counts"]["succeeded"] + done["counts"]["failed"] == 64
    assert done["stalled_since"] is None


def _poll(
    client: httpx.Client, job_id: str, ready: Callable[[dict[str, Any]], bool], timeout: float = 120
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if ready(job):
            return job
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} never got there in {timeout} s: {job}")
