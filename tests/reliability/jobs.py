"""Submitting jobs and reading their items over HTTP, shared by the reliability tests (awaiting
one: devstack.jobs)."""

from __future__ import annotations

import mimetypes
import re
from typing import Any

import httpx


def upload(client: httpx.Client, files: dict[str, bytes], model: str = "phash") -> httpx.Response:
    parts = [
        ("files", (name, data, mimetypes.guess_type(name)[0] or "application/octet-stream"))
        for name, data in files.items()
    ]
    return client.post("/v1/jobs", data={"model": model}, files=parts)


def items_by_key(client: httpx.Client, job_id: str) -> dict[str, dict[str, Any]]:
    """Every item of the job, by key, following the `next` cursor."""
    found: dict[str, dict[str, Any]] = {}
    after: str | int = 0
    for _ in range(100):  # 100 pages of 1000: far more than any job here
        response = client.get(f"/v1/jobs/{job_id}/items", params={"limit": 1000, "after": after})
        assert response.status_code == 200, response.text
        page = response.json()
        found.update({item["key"]: item for item in page["items"]})
        if page["next"] is None:
            return found
        after = page["next"]
    raise AssertionError(f"job {job_id} has more item pages than expected")


_REPR = re.compile(r"^\w+(Error|Exception)\(")  # a bare exception repr, e.g. "ValueError('x')"


def sentence_problem(text: object) -> str | None:
    """Why `text` is not a clear one-line sentence for a human, or None if it is one."""
    if not isinstance(text, str) or not text.strip():
        return "it is empty"
    if "Traceback" in text or "\n" in text:
        return "it is a traceback or spans lines"
    if _REPR.match(text):
        return "it is an exception's repr"
    if not text.rstrip().endswith((".", "?", "!")):
        return "it does not end as a sentence does"
    if len(text) > 400:
        return "it is too long to be one sentence"
    return None
