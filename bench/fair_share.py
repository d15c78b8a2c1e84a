"""Fair share between tenants on the bulk queue (issue 40): a tenant's small bulk job submitted
seconds after another tenant's large ones.

    python -m bench.fair_share [--a-jobs 4 --a-items 1000 --b-items 400 --delay 3]
    python -m bench.fair_share --model detector      # the issue's own case

Real stack (bench/stack.py: Postgres, Redis, moto S3, `kiln api`, `kiln worker`), the cheap
`phash` model by default (`--model`), the content cache off (every run computes). Per mode
(`--modes off,on`: a deployment with `KILN_FAIR_SHARE` false — one FIFO, as before the fair
share — then true), three runs over the same objects: B's job alone, A's jobs alone, then A's
jobs with B's submitted `--delay` seconds later. It prints B's time with A over B's time alone
(the target: within 3×) and A's total time with B against A's alone (it should grow by no more
than B's share: about B's time alone).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from sqlalchemy import func, select

from bench.stack import SOURCE_BUCKET, Layout, Stack, kiln_stack, local_deployment
from devstack.images import photo
from devstack.services import create_api_key
from kiln.app.db.models import Item
from kiln.app.db.session import make_engine, make_session_factory

CLOSED = {"completed", "failed", "cancelled"}


@dataclass(frozen=True)
class Figures:
    b_alone_s: float
    a_alone_s: float
    b_with_a_s: float
    a_with_b_s: float
    # Within the run with both, so a machine whose load changes between runs moves them less:
    # the share of A's items that finished after B's last (one FIFO: ~0), and when B ended
    # as a share of A's whole time (one FIFO: ~1).
    a_after_b: float = 0.0
    b_end_over_a_end: float = 0.0

    @property
    def b_ratio(self) -> float:
        return self.b_with_a_s / self.b_alone_s

    @property
    def a_growth_s(self) -> float:
        return self.a_with_b_s - self.a_alone_s

    def report(self) -> dict[str, float]:
        return {
            **asdict(self),
            "b_ratio": round(self.b_ratio, 2),
            "a_growth_s": round(self.a_growth_s, 2),
            "a_growth_over_b_alone": round(self.a_growth_s / self.b_alone_s, 2),
        }


def put_objects(stack: Stack, prefix: str, count: int, seed: int, size: tuple[int, int]) -> None:
    """`count` distinct JPEGs under `prefix` in the source bucket."""

    def put(i: int) -> None:
        body = photo(seed * 1_000_000 + i, size)
        stack.s3.put_object(Bucket=SOURCE_BUCKET, Key=f"{prefix}img-{i:05d}.jpg", Body=body)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


def submit(client: httpx.Client, prefix: str, model: str) -> str:
    body = {"model": model, "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}}
    response = client.post("/v1/jobs", json=body)
    if response.status_code != 202:
        raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
    return str(response.json()["id"])


def wait_all(client: httpx.Client, jobs: Sequence[str], timeout: float = 1800) -> float:
    """Seconds until every job of `jobs` closed (polled every 0.1 s), each completed."""
    start, open_jobs = time.monotonic(), set(jobs)
    while open_jobs:
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"jobs {sorted(open_jobs)} still open after {timeout:.0f} s")
        for job_id in sorted(open_jobs):
            job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in CLOSED:
                if job["status"] != "completed" or job["counts"]["failed"]:
                    raise RuntimeError(f"job {job_id} ended {job['status']}: {job['counts']}")
                open_jobs.discard(job_id)
        time.sleep(0.1)
    return time.monotonic() - start


@dataclass(frozen=True)
class Shape:
    a_jobs: int
    a_items: int
    b_items: int
    delay_s: float
    size: tuple[int, int]
    model: str = "phash"


def put_all(stack: Stack, shape: Shape) -> tuple[list[str], str]:
    """A's prefixes and B's, filled once: every run reads the same objects (the content cache
    is off, so each job computes them again)."""
    a_prefixes = [f"a{j}/" for j in range(shape.a_jobs)]
    for j, prefix in enumerate(a_prefixes):
        put_objects(stack, prefix, shape.a_items, j + 1, shape.size)
    put_objects(stack, "b/", shape.b_items, 99, shape.size)
    return a_prefixes, "b/"


def measure(
    stack: Stack, shape: Shape, a_prefixes: list[str], b_prefix: str, alone_only: bool = False
) -> Figures:
    """B alone, A alone, then A with B `delay_s` later, on one deployment (`alone_only`: A
    alone only, a lone tenant's throughput)."""
    keys = {
        t: create_api_key(stack.settings, t, (SOURCE_BUCKET,)) for t in ("tenant-a", "tenant-b")
    }
    clients = {
        t: httpx.Client(
            base_url=stack.api_url, headers={"Authorization": f"Bearer {k}"}, timeout=60
        )
        for t, k in keys.items()
    }
    a, b = clients["tenant-a"], clients["tenant-b"]
    try:
        if alone_only:
            return Figures(
                1.0, round(wait_all(a, [submit(a, p, shape.model) for p in a_prefixes]), 2), 0, 0
            )
        b_alone = wait_all(b, [submit(b, b_prefix, shape.model)])
        a_alone = wait_all(a, [submit(a, p, shape.model) for p in a_prefixes])
        start = time.monotonic()
        a_jobs = [submit(a, p, shape.model) for p in a_prefixes]
        time.sleep(shape.delay_s)
        b_job = submit(b, b_prefix, shape.model)
        with ThreadPoolExecutor(1) as pool:
            a_done = pool.submit(wait_all, a, a_jobs)
            b_with_a = wait_all(b, [b_job])
            a_done.result()
        a_with_b = time.monotonic() - start
    finally:
        for client in clients.values():
            client.close()
    return Figures(
        round(b_alone, 2), round(a_alone, 2), round(b_with_a, 2), round(a_with_b, 2),
        round(after(stack, a_jobs, b_job), 3), round((shape.delay_s + b_with_a) / a_with_b, 3),
    )  # fmt: skip


def after(stack: Stack, a_jobs: Sequence[str], b_job: str) -> float:
    """The share of A's items that finished after B's last item."""
    engine = make_engine(stack.settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            b_end = session.scalar(select(func.max(Item.finished_at)).where(Item.job_id == b_job))
            later = session.scalar(
                select(func.count()).where(Item.job_id.in_(a_jobs), Item.finished_at > b_end)
            )
            total = session.scalar(select(func.count()).where(Item.job_id.in_(a_jobs)))
    finally:
        engine.dispose()
    return (later or 0) / max(1, total or 0)


def main(
    a_jobs: Annotated[int, typer.Option(help="Tenant A's bulk jobs.")] = 4,
    a_items: Annotated[int, typer.Option(help="Objects per job of A.")] = 1000,
    b_items: Annotated[int, typer.Option(help="Objects of B's job.")] = 400,
    delay: Annotated[float, typer.Option(help="Seconds between A's jobs and B's.")] = 3.0,
    chunk: Annotated[int, typer.Option(help="KILN_BULK_CHUNK_SIZE.")] = 32,
    concurrency: Annotated[int, typer.Option(help="KILN_WORKER_CONCURRENCY.")] = 4,
    side: Annotated[int, typer.Option(help="Pictures' width (height ¾ of it).")] = 320,
    model: Annotated[str, typer.Option(help="The model every job runs.")] = "phash",
    modes: Annotated[
        str, typer.Option(help="KILN_FAIR_SHARE per deployment, in order (off = one FIFO).")
    ] = "off,on",
    alone_only: Annotated[
        bool, typer.Option(help="Only A's jobs alone per mode: a lone tenant's throughput.")
    ] = False,
    workdir: Annotated[Path, typer.Option(help="Logs.")] = Path(".kiln/bench-fair-share"),
    out: Annotated[Path | None, typer.Option(help="Write the figures as JSON here.")] = None,
) -> None:
    """B's time with A's backlog over its time alone, and A's growth, per mode."""
    workdir = workdir.resolve()  # the deployments' stores are file:// URIs
    workdir.mkdir(parents=True, exist_ok=True)
    kiln_settings = {
        "KILN_BULK_CHUNK_SIZE": str(chunk),
        "KILN_WORKER_CONCURRENCY": str(concurrency),
        "KILN_CONTENT_CACHE": "false",
    }
    shape = Shape(a_jobs, a_items, b_items, delay, (side, side * 3 // 4), model)
    report: dict[str, Any] = {"shape": asdict(shape), "runs": []}
    # The main stack holds the source objects (its moto); each mode is a deployment of its own
    # beside it (its database, Redis index, store and worker), so both read the same objects
    # under the same load, one after the other.
    with kiln_stack(workdir, kiln_settings) as parent:
        a_prefixes, b_prefix = put_all(parent, shape)
        for index, mode in enumerate(modes.split(",")):
            settings = {**kiln_settings, "KILN_FAIR_SHARE": "true" if mode == "on" else "false"}
            layout = Layout(name=f"{mode}{index}")
            with local_deployment(parent, workdir, settings, layout) as stack:
                figures = measure(stack, shape, a_prefixes, b_prefix, alone_only)
            run = {"fair_share": mode, **figures.report()}
            if alone_only:
                run = {"fair_share": mode, "a_alone_s": figures.a_alone_s}
            report["runs"].append(run)
            print(json.dumps(report["runs"][-1]), flush=True)
    print(json.dumps(report, indent=2))
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
