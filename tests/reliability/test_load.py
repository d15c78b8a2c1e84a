"""Load: 50 concurrent clients submit tiny phash jobs and poll them for KILN_LOAD_SECONDS (60).

No answer may be a 5xx or a broken connection, and no job may be lost: every job submitted
exists afterwards and completes. A 429 (the tenant rate limit, with Retry-After) is not an
error; it is counted and reported apart. The clients are spread over several tenants, as real
traffic is, so the per-tenant limit is not what is measured.
"""

from __future__ import annotations

import io
import os
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from PIL import Image

from devstack.jobs import CLOSED
from devstack.services import Process
from tests.stack import _key

CLIENTS = 50
TENANTS = 10
SECONDS = float(os.environ.get("KILN_LOAD_SECONDS", "60"))
POLL_INTERVAL_S = 0.25  # each client polls its open job 4 times a second
MAX_RETRY_AFTER_S = 5.0
DRAIN_TIMEOUT_S = 180.0  # after the load, every job must complete within this


@dataclass
class Tally:
    """What one client saw; merged over all clients at the end."""

    jobs: list[tuple[int, str]] = field(default_factory=list)  # (tenant index, job id)
    get_ms: list[float] = field(default_factory=list)
    submit_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # 5xx, broken connections, odd 4xx

    def merge(self, other: Tally) -> None:
        self.jobs += other.jobs
        self.get_ms += other.get_ms
        self.submit_ms += other.submit_ms
        self.statuses.update(other.statuses)
        self.failures += other.failures


def tiny_png(client: int, n: int) -> bytes:
    """A distinct 8×8 picture per job, so the content cache does not answer for the worker."""
    colour = (client * 5 % 256, n % 256, n // 256 % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buffer, "PNG")
    return buffer.getvalue()


class LoadClient:
    def __init__(self, http: httpx.Client, index: int, tenant: int, deadline: float) -> None:
        self.http, self.index, self.tenant, self.deadline = http, index, tenant, deadline
        self.tally = Tally()

    def request(self, method: str, path: str, timings: list[float], **kw: Any) -> Any:
        """The response, or None when the connection broke (recorded as a failure)."""
        started = time.perf_counter()
        try:
            response = self.http.request(method, path, **kw)
        except httpx.TransportError as error:
            self.tally.failures.append(f"{method} {path}: {type(error).__name__}: {error}")
            return None
        timings.append((time.perf_counter() - started) * 1000)
        self.tally.statuses[response.status_code] += 1
        if response.status_code >= 500 or (
            response.status_code >= 400 and response.status_code != 429
        ):
            self.tally.failures.append(
                f"{method} {path}: {response.status_code} {response.text[:200]}"
            )
        return response

    def backoff(self, response: httpx.Response) -> None:
        retry_after = float(response.headers.get("Retry-After", "1"))
        time.sleep(min(max(retry_after, 0.1), MAX_RETRY_AFTER_S))

    def run(self) -> Tally:
        n = 0
        while time.monotonic() < self.deadline:
            n += 1
            files = [("files", (f"tiny-{n}.png", tiny_png(self.index, n), "image/png"))]
            response = self.request(
                "POST", "/v1/jobs", self.tally.submit_ms, data={"model": "phash"}, files=files
            )
            if response is None or response.status_code not in (202, 429):
                time.sleep(POLL_INTERVAL_S)
            elif response.status_code == 429:
                self.backoff(response)
            else:
                job_id = response.json()["id"]
                self.tally.jobs.append((self.tenant, job_id))
                self.poll(job_id)
        return self.tally

    def poll(self, job_id: str) -> None:
        """Poll until the job closes or the load ends (the drain checks it then)."""
        while time.monotonic() < self.deadline:
            time.sleep(POLL_INTERVAL_S)
            response = self.request("GET", f"/v1/jobs/{job_id}", self.tally.get_ms)
            if response is None or response.status_code != 200:
                if response is not None and response.status_code == 429:
                    self.backoff(response)
                continue
            if response.json()["status"] in CLOSED:
                return


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def drain(clients: list[httpx.Client], jobs: list[tuple[int, str]]) -> Counter[str]:
    """Each job's final status, waiting (bounded) for those still open."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    outcome: Counter[str] = Counter()
    for tenant, job_id in jobs:
        while True:
            remaining = deadline - time.monotonic()
            wait = max(0.0, min(remaining, 10.0))
            response = clients[tenant].get(f"/v1/jobs/{job_id}", params={"wait": wait})
            if response.status_code == 429:
                time.sleep(1)
                continue
            assert response.status_code == 200, f"job {job_id} is lost: {response.text}"
            job = response.json()
            if job["status"] in CLOSED or remaining <= 0:
                ok = job["status"] == "completed" and job["counts"]["succeeded"] == 1
                outcome["completed" if ok else f"{job['status']}, {job['counts']}"] += 1
                break
    return outcome


@pytest.fixture(scope="module")
def tenant_clients(api_url: str, sessions: Any) -> Any:
    clients = []
    for index in range(TENANTS):
        headers = {"Authorization": f"Bearer {_key(sessions, f'load-{index}')}"}
        clients.append(httpx.Client(base_url=api_url, headers=headers, timeout=60))
    yield clients
    for client in clients:
        client.close()


def test_fifty_clients_lose_nothing_and_see_no_server_error(
    api_url: str,
    worker: Process,
    tenant_clients: list[httpx.Client],
    request: pytest.FixtureRequest,
) -> None:
    started = time.monotonic()
    deadline = started + SECONDS
    http = [
        httpx.Client(base_url=api_url, headers=tenant_clients[i % TENANTS].headers, timeout=60)
        for i in range(CLIENTS)
    ]
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [
                pool.submit(LoadClient(http[i], i, i % TENANTS, deadline).run)
                for i in range(CLIENTS)
            ]
            tally = Tally()
            for future in futures:
                tally.merge(future.result(timeout=SECONDS + 120))
    finally:
        for client in http:
            client.close()
    elapsed = time.monotonic() - started
    outcome = drain(tenant_clients, tally.jobs)

    figures = {
        "clients": CLIENTS,
        "seconds": round(elapsed, 1),
        "jobs_submitted": len(tally.jobs),
        "submits_per_second": round(len(tally.jobs) / elapsed, 1),
        "requests_per_second": round(sum(tally.statuses.values()) / elapsed, 1),
        "get_job_p50_ms": round(percentile(tally.get_ms, 50), 1),
        "get_job_p99_ms": round(percentile(tally.get_ms, 99), 1),
        "submit_p50_ms": round(percentile(tally.submit_ms, 50), 1),
        "submit_p99_ms": round(percentile(tally.submit_ms, 99), 1),
        "throttled_429": tally.statuses[429],
        "server_errors": sum(n for code, n in tally.statuses.items() if code >= 500),
        "statuses": dict(sorted(tally.statuses.items())),
        "outcomes": dict(outcome),
    }
    # What `record_property` does, without its warning (an error here) under --junitxml's
    # default xunit2: the figures land in the test report's user_properties.
    request.node.user_properties.extend(figures.items())
    print("\nload: " + ", ".join(f"{name}={value}" for name, value in figures.items()))

    assert tally.jobs, "no job was accepted during the load"
    assert not tally.failures, f"{len(tally.failures)} failures, e.g. {tally.failures[:5]}"
    assert outcome == {"completed": len(tally.jobs)}, f"jobs that did not complete: {outcome}"
