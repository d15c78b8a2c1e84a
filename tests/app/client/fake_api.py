"""A stand-in Kiln API for the client's unit tests: answers as the real one's schemas say,
records every request, served through httpx.MockTransport (no socket)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

Handler = Callable[[httpx.Request], httpx.Response]


def job_json(job_id: str = "j1", status: str = "queued", **extra: Any) -> dict[str, Any]:
    """A JobOut as the API writes it."""
    counts = {"total": 2, "succeeded": 0, "failed": 0, "pending": 2, "cancelled": 0}
    return {
        "id": job_id,
        "model": "phash",
        "status": status,
        "counts": {**counts, **extra.pop("counts", {})},
        "created_at": "2026-11-29T04:00:00Z",
        "started_at": None,
        "finished_at": None,
        "items_per_second": None,
        "results_url": f"http://api/v1/jobs/{job_id}/results",
        **extra,
    }


def parquet(rows: list[dict[str, Any]], row_group: int | None = None) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=row_group)
    return sink.getvalue()


@dataclass
class FakeApi:
    """Routes by (method, path) to a handler; `seen` keeps every request in order."""

    routes: dict[tuple[str, str], Handler] = field(default_factory=dict)
    seen: list[httpx.Request] = field(default_factory=list)

    def on(self, method: str, path: str, answer: Handler | Any, status: int = 200) -> None:
        if callable(answer):
            self.routes[(method, path)] = answer
        else:
            self.routes[(method, path)] = lambda _r: httpx.Response(status, json=answer)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        key = (request.method, request.url.path)
        if key not in self.routes:
            return httpx.Response(404, json={"detail": f"No route {key}."})
        return self.routes[key](request)

    def body(self, n: int = -1) -> Any:
        return json.loads(self.seen[n].content)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)
