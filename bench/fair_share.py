"""Fair share between tenants on the bulk queue (issue 40): a tenant's small bulk job submitted
seconds after another tenant's large ones.

    python -m bench.fair_share [--a-jobs 4 --a-items 1000 --b-items 400 --delay 3]

Real stack (bench/stack.py: Postgres, Redis, moto S3, `kiln api`, `kiln worker`), the cheap
`phash` model, the content cache off (every run computes). Three runs on fresh objects each:
B's job alone, A's jobs alone, then A's jobs with B's submitted `--delay` seconds later. It
prints B's time with A over B's time alone (the target: within 3×) and A's total time with B
against A's alone plus B's alone (A grows by no more than B's share).
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

from bench.stack import SOURCE_BUCKET, Stack, kiln_stack
from devstack.images import photo
from devstack.services import create_api_key

CLOSED = {"completed", "failed", "cancelled"}


@dataclass(frozen=True)
class Figures:
    b_alone_s: float
    a_alone_s: float
    b_with_a_s: float
    a_with_b_s: float

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


def submit(client: httpx.Client, prefix: str) -> str:
    body = {"model": "phash", "source": {"s3": f"s3://{SOURCE_BUCKET}/{prefix}"}}
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


class Run:
    def __init__(self, stack: Stack, a: httpx.Client, b: httpx.Client, shape: Shape) -> None:
        self.stack, self.a, self.b, self.shape = stack, a, b, shape
        self.round = 0

    def _prefixes(self, tenant: str, jobs: int, items: int) -> list[str]:
        """Fresh objects for one run (new pictures: nothing cached anywhere)."""
        self.round += 1
        prefixes = [f"r{self.round}/{tenant}{j}/" for j in range(jobs)]
        for j, prefix in enumerate(prefixes):
            put_objects(self.stack, prefix, items, self.round * 100 + j, self.shape.size)
        return prefixes

    def b_alone(self) -> float:
        (prefix,) = self._prefixes("b", 1, self.shape.b_items)
        return wait_all(self.b, [submit(self.b, prefix)])

    def a_alone(self) -> float:
        prefixes = self._prefixes("a", self.shape.a_jobs, self.shape.a_items)
        return wait_all(self.a, [submit(self.a, p) for p in prefixes])

    def together(self) -> tuple[float, float]:
        """A's jobs, then B's `delay` seconds later: (B's time from its submission, A's)."""
        a_prefixes = self._prefixes("a", self.shape.a_jobs, self.shape.a_items)
        (b_prefix,) = self._prefixes("b", 1, self.shape.b_items)
        start = time.monotonic()
        a_jobs = [submit(self.a, p) for p in a_prefixes]
        time.sleep(self.shape.delay_s)
        b_job = submit(self.b, b_prefix)
        with ThreadPoolExecutor(1) as pool:
            a_done = pool.submit(wait_all, self.a, a_jobs)
            b_s = wait_all(self.b, [b_job])
            a_done.result()
        return b_s, time.monotonic() - start


@dataclass(frozen=True)
class Shape:
    a_jobs: int
    a_items: int
    b_items: int
    delay_s: float
    size: tuple[int, int]


def measure(stack: Stack, shape: Shape) -> Figures:
    keys = {
        t: create_api_key(stack.settings, t, (SOURCE_BUCKET,)) for t in ("tenant-a", "tenant-b")
    }
    clients = {
        t: httpx.Client(
            base_url=stack.api_url, headers={"Authorization": f"Bearer {k}"}, timeout=60
        )
        for t, k in keys.items()
    }
    try:
        run = Run(stack, clients["tenant-a"], clients["tenant-b"], shape)
        b_alone = run.b_alone()
        a_alone = run.a_alone()
        b_with_a, a_with_b = run.together()
    finally:
        for client in clients.values():
            client.close()
    return Figures(round(b_alone, 2), round(a_alone, 2), round(b_with_a, 2), round(a_with_b, 2))


def main(
    a_jobs: Annotated[int, typer.Option(help="Tenant A's bulk jobs.")] = 4,
    a_items: Annotated[int, typer.Option(help="Objects per job of A.")] = 1000,
    b_items: Annotated[int, typer.Option(help="Objects of B's job.")] = 400,
    delay: Annotated[float, typer.Option(help="Seconds between A's jobs and B's.")] = 3.0,
    chunk: Annotated[int, typer.Option(help="KILN_BULK_CHUNK_SIZE.")] = 32,
    concurrency: Annotated[int, typer.Option(help="KILN_WORKER_CONCURRENCY.")] = 4,
    side: Annotated[int, typer.Option(help="Pictures' width (height ¾ of it).")] = 320,
    workdir: Annotated[Path, typer.Option(help="Logs.")] = Path(".kiln/bench-fair-share"),
    out: Annotated[Path | None, typer.Option(help="Write the figures as JSON here.")] = None,
) -> None:
    """B's time with A's backlog over its time alone, and A's growth."""
    workdir.mkdir(parents=True, exist_ok=True)
    worker_env = {
        "KILN_BULK_CHUNK_SIZE": str(chunk),
        "KILN_WORKER_CONCURRENCY": str(concurrency),
        "KILN_CONTENT_CACHE": "false",
        "KILN_TENANT_MAX_OPEN_JOBS": "1000",
    }
    shape = Shape(a_jobs, a_items, b_items, delay, (side, side * 3 // 4))
    with kiln_stack(workdir, worker_env) as stack:
        figures = measure(stack, shape)
    report = {"shape": asdict(shape), **figures.report()}
    print(json.dumps(report, indent=2))
    if out is not None:
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
