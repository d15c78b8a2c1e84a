"""The console's pages on a big job (issue 18): server time to render each page of a job of
100,000 items in Postgres, in-process through the ASGI app (what a browser waits for, less
the network).

    python -m bench.console                      # 100,000 items, 30 renders per page
    python -m bench.console --items 1000000 --repeats 10

The job is written straight to a scratch database with COPY (as `bench.cases.bigjob` does),
then a tenth of its items are marked succeeded with OCR-like outputs and a hundredth failed,
so the grid and its filter page real rows. Prints a table, writes `bench/results/console-*.json`.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import psycopg
import typer
from sqlalchemy.engine import make_url

from bench import report
from bench.cases.bigjob import create_big_job, database_dsn
from kiln.app.api.app import create_app
from kiln.app.core.config import get_settings
from kiln.app.db.migrate import upgrade
from kiln.app.tenants.auth import create_key

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Starlette's note that it falls back to httpx
    from fastapi.testclient import TestClient

HERE = Path(__file__).parent
SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SCRATCH = "kiln_bench_console"
TENANT = "bench"


@contextmanager
def scratch_database(server: str) -> Iterator[str]:
    """A fresh database on `server`, dropped afterwards; yields its SQLAlchemy URL."""
    admin = database_dsn(server)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {SCRATCH} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {SCRATCH}")
    try:
        yield make_url(server).set(database=SCRATCH).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {SCRATCH} WITH (FORCE)")


def finish_some(dsn: str, job_id: str, items: int) -> None:
    """A tenth of the items succeeded (with outputs), a hundredth failed, the job running for
    an hour with its items finishing through it (so the throughput chart has a history)."""
    outputs = json.dumps({"text": "INVOICE 0042 total 12.50", "lines": []})
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "UPDATE items SET status = 'succeeded', outputs = %s::json, duration_ms = 12.5,"
            " started_at = now() - (id %% 3600) * interval '1 second',"
            " finished_at = now() - (id %% 3600) * interval '1 second'"
            " WHERE job_id = %s AND id %% 10 = 0",
            (outputs, job_id),
        )
        conn.execute(
            "UPDATE items SET status = 'failed', error = 'The input is not a picture Kiln can"
            " read.', started_at = now() - (id %% 3600) * interval '1 second',"
            " finished_at = now() - (id %% 3600) * interval '1 second'"
            " WHERE job_id = %s AND id %% 100 = 1",
            (job_id,),
        )
        conn.execute(
            "UPDATE jobs SET status = 'running', started_at = now() - interval '1 hour'"
            " WHERE id = %s",
            (job_id,),
        )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE items")


def timed(http: TestClient, path: str, repeats: int) -> dict[str, float]:
    http.get(path)  # warm: templates compiled, plans cached
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        answer = http.get(path)
        times.append((time.perf_counter() - started) * 1000)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[:300])
    values = np.asarray(times)
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 1),
        "p99_ms": round(float(np.percentile(values, 99)), 1),
        "bytes": len(answer.content),
    }


def sign_in(http: TestClient, key: str) -> None:
    page = http.get("/console/login").text
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found
    http.post("/console/login", data={"key": key, "csrf": found.group(1)})


def measure(items: int, repeats: int, server: str = SERVER) -> dict[str, Any]:
    with scratch_database(server) as url, tempfile.TemporaryDirectory() as folder:
        settings = get_settings(data_dir=Path(folder), database_url=url)
        upgrade(settings)
        dsn = database_dsn(url)
        started = time.perf_counter()
        job = create_big_job(
            dsn, tenant=TENANT, model_ref="ocr", total=items, chunk_size=64, inputs=["x.png"]
        )
        finish_some(dsn, job, items)
        made = time.perf_counter() - started
        with TestClient(create_app(settings)) as http:
            with http.app.state.kiln.sessions() as session:  # type: ignore[attr-defined]
                key = create_key(session, TENANT).secret
            sign_in(http, key)
            last = items - 100
            pages = {
                "jobs list": "/console/",
                "job page": f"/console/jobs/{job}",
                "job summary (polled every 2 s)": f"/console/jobs/{job}/summary",
                "items, first page (48)": f"/console/jobs/{job}/items",
                "items, failed only": f"/console/jobs/{job}/items?status=failed",
                "items, a page near the end": f"/console/jobs/{job}/items?after={last}",
                "throughput (once per view)": f"/console/jobs/{job}/throughput.json",
            }
            figures = {name: timed(http, path, repeats) for name, path in pages.items()}
    return {"items": items, "setup_s": round(made, 1), "repeats": repeats, "pages": figures}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"| page ({result['items']:,}-item job) | p50 ms | p99 ms | KB |",
        "|---|---|---|---|",
    ]
    for name, f in result["pages"].items():
        lines.append(f"| {name} | {f['p50_ms']} | {f['p99_ms']} | {f['bytes'] / 1024:.1f} |")
    return "\n".join(lines)


def main(
    items: Annotated[int, typer.Option(help="Items in the job.")] = 100_000,
    repeats: Annotated[int, typer.Option(help="Renders per page.")] = 30,
    results_dir: Annotated[Path, typer.Option(help="Where the JSON goes.")] = HERE / "results",
) -> None:
    """Time each console page of one big job; print a Markdown table and save the JSON."""
    result = measure(items, repeats)
    print(markdown(result))
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = results_dir / f"console-{stamp}.json"
    path.write_text(json.dumps({"machine": report.machine(), **result}, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    typer.run(main)
