"""Bulk ingest rate: list + insert + enqueue for a bucket of N keys, and the lister's memory.

    python -m bench.ingest --keys 10000,100000

Real moto S3 server, Postgres and Redis (as the services case). Objects are empty (listing
does not read them). The ingest runs in this process as a worker would run it — step after
step, each listing `ingest_pages_per_step` pages — with backpressure off, so the figure is the
ingest's own rate; chunks go to Redis through the real dispatcher and are counted there, not
processed. Peak RSS is sampled during each run, against the process's size just before it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from devstack.services import backing_services, settings_for
from kiln.app.db.migrate import upgrade
from kiln.app.db.models import Ingest
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.tenants.tenants import allow_bucket
from kiln.workers.celery.app import make_celery
from kiln.workers.jobs.ingest import ingest_step
from kiln.workers.runtime import WorkerRuntime

BUCKET = "kiln-bench-ingest"


def main(
    keys: Annotated[str, typer.Option(help="Bucket sizes, comma-separated.")] = "10000,100000",
    workdir: Annotated[Path, typer.Option(help="Logs.")] = Path(".kiln/bench-ingest"),
) -> None:
    """Measure keys/s of list + insert + enqueue, and peak RSS, per bucket size."""
    console = Console()
    sizes = [int(k) for k in keys.split(",")]
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    with _services(workdir) as (env, s3):
        for size in sizes:
            prefix = f"n{size}/"
            with console.status(f"putting {size:,} empty objects into moto…"):
                _fill(s3, prefix, size)
            with console.status(f"ingesting {size:,} keys…"):
                rows.append(_ingest(env, prefix, size))
            console.print(f"{size:,} keys: {rows[-1]['keys_per_s']:,.0f} keys/s")
    table = Table("keys", "seconds", "keys/s", "chunks sent", "steps", "peak RSS +MB")
    for r in rows:
        table.add_row(
            f"{r['keys']:,}", f"{r['seconds']:.1f}", f"{r['keys_per_s']:,.0f}",
            f"{r['chunks']:,}", str(r["steps"]), f"{r['rss_mb']:.0f}",
        )  # fmt: skip
    console.print(table)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        console.print(
            f"rate ratio {last['keys']:,} ÷ {first['keys']:,} keys: "
            f"{last['keys_per_s'] / first['keys_per_s']:.2f}; peak RSS growth "
            f"{first['rss_mb']:.0f} MB → {last['rss_mb']:.0f} MB"
        )


@contextmanager
def _services(workdir: Path) -> Iterator[tuple[dict[str, str], Any]]:
    """The stack's services (devstack), and the KILN_* settings of a Kiln on them."""
    with backing_services(workdir, (BUCKET,), db_prefix="kiln_bench_ingest") as backing:
        env = backing.kiln_env(
            workdir / "data",
            f"s3://{BUCKET}/kiln",
            bulk_max_chunks="100000000",  # measure the ingest itself, not the consumers
        )
        upgrade(settings_for(env))
        yield env, backing.s3


def _fill(s3: Any, prefix: str, count: int) -> None:
    def put(i: int) -> None:
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}{i // 1000:04d}/img-{i:07d}.jpg", Body=b"")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


class _Steps:
    """A dispatcher that sends chunks to Redis and keeps ingest steps to run here, in turn."""

    def __init__(self, real: CeleryDispatcher) -> None:
        self.real, self.chunks = real, 0
        self.next_owner: str | None = None
        self.more = False

    def enqueue_chunk(self, job_id: str, chunk: int, item_ids: list[int], queue: str) -> None:
        self.real.enqueue_chunk(job_id, chunk, item_ids, queue)
        self.chunks += 1

    def enqueue_ingest(self, job_id: str, owner: str | None = None, countdown: float = 0) -> None:
        self.more, self.next_owner = True, owner


def _ingest(env: dict[str, str], prefix: str, size: int) -> dict[str, Any]:
    settings = settings_for(env)
    celery = make_celery(settings)
    runtime = WorkerRuntime(settings, "bench@localhost")
    steps = _Steps(CeleryDispatcher(celery))
    try:
        with runtime.sessions() as session:
            allow_bucket(session, "bench", BUCKET)
            job = submit_bulk(
                session, steps, BulkRequest("bench", "phash", Source(f"s3://{BUCKET}/{prefix}"))
            ).job
            job_id = job.id
        with _peak_rss() as peak:
            started = time.perf_counter()
            count = 0
            owner_: str | None = None
            while True:
                steps.more = False
                ingest_step(runtime, steps, job_id, owner_)
                count += 1
                if not steps.more:
                    break
                owner_ = steps.next_owner
            seconds = time.perf_counter() - started
        with runtime.sessions() as session:
            ingest = session.get(Ingest, job_id)
            assert ingest is not None and ingest.done and ingest.listed == size, ingest
        return {
            "keys": size,
            "seconds": seconds,
            "keys_per_s": size / seconds,
            "chunks": steps.chunks,
            "steps": count,
            "rss_mb": peak["mb"],
        }
    finally:
        runtime.close()
        celery.close()


@contextmanager
def _peak_rss() -> Iterator[dict[str, float]]:
    process = psutil.Process()
    base = process.memory_info().rss
    result = {"mb": 0.0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            result["mb"] = max(result["mb"], (process.memory_info().rss - base) / 2**20)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        done.set()
        thread.join()


if __name__ == "__main__":
    typer.run(main)
