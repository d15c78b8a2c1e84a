"""Awaiting a job over Kiln's HTTP API, as a client does: the tests and the benches share it."""

from __future__ import annotations

import time
from typing import Any

import httpx

CLOSED = frozenset({"completed", "failed", "cancelled"})


def wait_closed(
    client: httpx.Client, job_id: str, timeout: float = 180, poll_s: float = 10.0
) -> dict[str, Any]:
    """The job once it is closed, waiting on the API's long poll (`?wait=`, at most `poll_s` a
    request); a TimeoutError naming its last status after `timeout` s."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while (remaining := deadline - time.monotonic()) > 0:
        response = client.get(f"/v1/jobs/{job_id}", params={"wait": min(remaining, poll_s)})
        response.raise_for_status()
        job = response.json()
        if job["status"] in CLOSED:
            return job
    raise TimeoutError(f"job {job_id} is still {job.get('status')} after {timeout:.0f} s: {job}")
