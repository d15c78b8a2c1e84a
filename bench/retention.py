"""Retention at the issue's scale (issue 40): 30 nightly runs of a 10,000-object pipeline kept
7 days, and what the sweep costs a concurrent chunk's write.

    python -m bench.retention                       # 30 nights × 10,000 objects
    python -m bench.retention --nights 10 --objects 2000

On real Postgres and moto's S3 server (a database and bucket of its own). Each night adds a
closed run of the pipeline as a night's run leaves it — its 10,000 item rows, counters, one
shard per 512 items plus its manifest in the store, and the pipeline's per-object rows
(`pipeline_objects`) upserted — without running inference (the path through `kiln worker` is
tests/integration/test_retention.py's, at 30 × 100). Then a day passes (every run's end and
expiry move back a day) and the sweep `kiln beat`'s reconcile runs (`workers/jobs/retention.py`)
ticks until nothing is due, while another thread writes chunks of an open job as a worker does
(8 items' results and the job's counters, one transaction) and times each write; the same
writes are timed alone for a second just before, as the host's own noise to compare with.

One JSON line per night (item rows, objects, pipeline objects, the sweep's ticks and seconds,
the chunk writes' median and worst), then a summary line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy import func, select, text, update

from devstack.services import backing_services, settings_for
from kiln.app.core.config import Settings
from kiln.app.db import counters
from kiln.app.db.migrate import upgrade
from kiln.app.db.models import Item, Job, JobStatus, Pipeline, PipelineObject, utcnow
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.results import results
from kiln.app.storage import ObjectStore, open_store
from kiln.app.storage.s3 import make_s3_client
from kiln.workers.jobs import retention as sweeper

BUCKET = "kiln-bench-retention"
DAY = timedelta(days=1)
SHARD_ITEMS = 512
ALONE_S = 1.0  # chunk writes timed alone each night, before the sweep


@dataclass
class Runtime:
    """What the sweep uses of a worker's runtime."""

    settings: Settings
    sessions: Any
    store: ObjectStore

    def place(self, job_id: str, output: str | None) -> results.Place:
        return results.place_for(self.store, job_id, output, lambda: make_s3_client(self.settings))


def main(
    nights: Annotated[int, typer.Option(help="Nightly runs.")] = 30,
    objects: Annotated[int, typer.Option(help="Objects per night.")] = 10_000,
    kept_days: Annotated[int, typer.Option(help="The runs' retention, in days.")] = 7,
) -> None:
    with (
        tempfile.TemporaryDirectory() as tmp,
        backing_services(Path(tmp), [BUCKET], "kiln_bench_retention") as services,
    ):
        env = services.kiln_env(Path(tmp) / "data", f"s3://{BUCKET}/kiln")
        settings = settings_for(env)
        upgrade(settings)
        engine = make_engine(settings.database_url)
        sessions = make_session_factory(engine)
        runtime = Runtime(settings, sessions, open_store(settings))
        try:
            summary = _nights(runtime, nights, objects, kept_days)
        finally:
            engine.dispose()
    print(json.dumps({"measure": "summary", **summary}), flush=True)


def _nights(runtime: Runtime, nights: int, objects: int, kept_days: int) -> dict[str, Any]:
    pipeline_id = _pipeline(runtime)
    busy, ids = _open_job(runtime, 8 * 50_000)
    runs: list[str] = []
    peaks = {"rows": 0, "objects": 0}
    worst_write = worst_alone = 0.0
    for night in range(nights):
        runs.append(_a_night(runtime, pipeline_id, night, objects, kept_days))
        _a_day_passes(runtime, runs)
        mine = ids[night * 8 * 1500 : (night + 1) * 8 * 1500]
        alone: list[float] = []  # the same writes with no sweep, just before: this host's noise
        quiet = threading.Event()
        threading.Timer(ALONE_S, quiet.set).start()
        _writes(runtime, busy, mine[: len(mine) // 2], quiet, alone)
        stop = threading.Event()
        took: list[float] = []
        writer = threading.Thread(
            target=_writes, args=(runtime, busy, mine[len(mine) // 2 :], stop, took)
        )
        writer.start()
        started, ticks = time.perf_counter(), 0
        while True:
            ticks += 1
            report = sweeper.sweep(runtime)
            if not report["expired_rows"] and not report["expired_objects"]:
                break
        swept_s = time.perf_counter() - started
        stop.set()
        writer.join()
        rows, stored = _rows(runtime, runs), _objects(runtime, runs)
        peaks = {"rows": max(peaks["rows"], rows), "objects": max(peaks["objects"], stored)}
        worst_write = max([worst_write, *took])
        worst_alone = max([worst_alone, *alone])
        line = {
            "measure": "night", "night": night + 1, "item_rows": rows, "objects": stored,
            "pipeline_objects": _pipeline_objects(runtime, pipeline_id), "sweep_ticks": ticks,
            "sweep_s": round(swept_s, 2), "writes": len(took),
            "write_median_ms": round(statistics.median(took) * 1000, 1) if took else None,
            "write_max_ms": round(max(took) * 1000, 1) if took else None,
            "alone_median_ms": round(statistics.median(alone) * 1000, 1) if alone else None,
            "alone_max_ms": round(max(alone) * 1000, 1) if alone else None,
        }  # fmt: skip
        print(json.dumps(line), flush=True)
    return {
        "nights": nights, "objects": objects, "kept_days": kept_days,
        "peak_item_rows": peaks["rows"], "peak_objects": peaks["objects"],
        "bound_item_rows": kept_days * objects, "worst_write_ms": round(worst_write * 1000, 1),
        "worst_alone_ms": round(worst_alone * 1000, 1),
    }  # fmt: skip


def _pipeline(runtime: Runtime) -> int:
    with runtime.sessions() as session:
        pipeline = Pipeline(
            tenant="bench", name="nightly", source={"s3": "s3://b/p/"}, model="phash"
        )
        session.add(pipeline)
        session.commit()
        return int(pipeline.id)


def _a_night(runtime: Runtime, pipeline_id: int, night: int, objects: int, kept: int) -> str:
    """A closed run as a night leaves it: its items, counters, shards and manifest, and the
    pipeline's objects at their new ETags."""
    job_id = str(uuid.uuid4())
    now = utcnow()
    with runtime.sessions() as session:
        session.add(
            Job(id=job_id, tenant="bench", model="phash", status=JobStatus.COMPLETED,
                queue="bulk", pipeline_id=pipeline_id, source={"s3": "s3://b/p/"},
                retention_s=kept * 86_400, created_at=now, started_at=now, finished_at=now)
        )  # fmt: skip
        session.flush()
        session.execute(
            text(
                "INSERT INTO items (job_id, key, source, etag, chunk, status, attempts, outputs,"
                " finished_at) SELECT :job, 'obj-' || g, 's3://b/p/obj-' || g, :etag,"
                " g / :shard, 'succeeded', 1, CAST('{\"phash\": \"0123456789abcdef\"}' AS json),"
                " :now FROM generate_series(0, :n - 1) AS g"
            ),
            {"job": job_id, "etag": f"e{night}", "shard": SHARD_ITEMS, "n": objects, "now": now},
        )
        session.execute(
            text(
                "INSERT INTO pipeline_objects (pipeline_id, key, etag, seen_job, done_etag,"
                " done_model) SELECT :p, 'obj-' || g, :etag, :job, :etag, 'phash'"
                " FROM generate_series(0, :n - 1) AS g ON CONFLICT (pipeline_id, key) DO UPDATE"
                " SET etag = excluded.etag, seen_job = excluded.seen_job,"
                " done_etag = excluded.done_etag"
            ),
            {"p": pipeline_id, "etag": f"e{night}", "job": job_id, "n": objects},
        )
        counters.add(session, job_id, 0, counters.Tally(total=objects, succeeded=objects))
        session.commit()
    place = runtime.place(job_id, None)
    for shard in range(-(-objects // SHARD_ITEMS)):
        place.store.put(results.shard_key(place, shard), b"PAR1 a shard's stand-in PAR1")
    place.store.put(results.manifest_key(place), b"{}")
    return job_id


def _a_day_passes(runtime: Runtime, runs: list[str]) -> None:
    with runtime.sessions() as session:
        session.execute(
            update(Job)
            .where(Job.id.in_(runs))
            .values(finished_at=Job.finished_at - DAY, expires_at=Job.expires_at - DAY)
        )
        session.commit()


def _open_job(runtime: Runtime, items: int) -> tuple[str, list[int]]:
    job_id = str(uuid.uuid4())
    with runtime.sessions() as session:
        session.add(Job(id=job_id, tenant="bench", model="phash", status=JobStatus.RUNNING))
        session.flush()
        ids = (
            session.execute(
                text(
                    "INSERT INTO items (job_id, key, chunk, status, attempts)"
                    " SELECT :job, 'w-' || g, g / 8, 'running', 1"
                    " FROM generate_series(0, :n - 1) AS g RETURNING id"
                ),
                {"job": job_id, "n": items},
            )
            .scalars()
            .all()
        )
        counters.add(session, job_id, 0, counters.Tally(total=items))
        session.commit()
    return job_id, sorted(ids)


def _writes(
    runtime: Runtime, job_id: str, ids: list[int], stop: threading.Event, took: list[float]
) -> None:
    """A chunk's write as a worker makes it, again and again, each one timed into `took`."""
    for chunk in range(len(ids) // 8):
        if stop.is_set():
            break
        started = time.perf_counter()
        with runtime.sessions() as session:
            session.execute(
                update(Item)
                .where(Item.id.in_(ids[chunk * 8 : (chunk + 1) * 8]))
                .values(status="succeeded", outputs={"phash": "00ff"}, finished_at=utcnow())
            )
            counters.add(session, job_id, chunk % 16, counters.Tally(succeeded=8))
            session.commit()
        took.append(time.perf_counter() - started)
        time.sleep(0.005)


def _rows(runtime: Runtime, runs: list[str]) -> int:
    with runtime.sessions() as session:
        return int(session.scalar(select(func.count()).where(Item.job_id.in_(runs))) or 0)


def _objects(runtime: Runtime, runs: list[str]) -> int:
    return sum(len(list(runtime.store.list(results.results_prefix(r)))) for r in runs)


def _pipeline_objects(runtime: Runtime, pipeline_id: int) -> int:
    with runtime.sessions() as session:
        query = select(func.count()).where(PipelineObject.pipeline_id == pipeline_id)
        return int(session.scalar(query) or 0)


if __name__ == "__main__":
    typer.run(main)
