"""bigjob: does Kiln's cost per item and per poll stay flat when one job holds 1,000,000 items?

The job is written straight into Postgres with COPY (a jobs row; items as the API writes them:
`chunk = index // chunk_size`, pending), all its items reading a handful of small inputs put
once into Kiln's (local) store, for the null model. Only the first chunks are sent — enough for
the window at a rate above the issue's target — through Kiln's own dispatcher, to several
`kiln worker` processes of one deployment. While they finish chunks, the driver polls
`GET /v1/jobs/{id}` back to back (latency percentiles, items finished per second) and a
sampler reads `pg_stat_activity` every 50 ms: how often a worker's backend waits on a lock,
and on which statement (the job row `FOR UPDATE` every chunk of the job shares, or another).
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pyarrow as pa

from bench.cases.services import meter
from bench.context import Context
from bench.inputs import make_images
from bench.measure import percentiles
from bench.results import CaseResult
from bench.stack import Layout, Stack, local_deployment
from kiln.app import sources
from kiln.app.catalog.catalog import get_model
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.dispatch.contract import BULK
from kiln.app.dispatch.producer import CeleryDispatcher, make_producer
from kiln.app.results import results
from kiln.app.storage import open_store

TENANT = "bench"  # the API key's tenant (bench/stack.py): GET /v1/jobs/{id} is tenant-scoped
MODEL = "null"
INPUTS = 8  # distinct small inputs; every item reads one of them
MAX_RATE = 4000  # items/s: chunks are sent for this rate over warm-up + window, twice the goal
WARM_S = 10.0  # at most, before the window: the workers load the model on their first chunk
POLL_PAUSE_S = 0.01  # between two GETs: a client polling as fast as answers come
LOCK_SAMPLE_S = 0.05
COPY_ROWS = 50_000  # rows per write to the COPY stream
# Several workers on 2 cores: one engine thread each, and 8 chunks at a time each with a pool
# to match, so three of them stay well inside Postgres's 100 connections (shared here); one
# prep process each, as workers sharing a host split its cores (`--devices all` does the same).
WORKER_ENV = (
    ("KILN_RUNNERS", "1"),
    ("KILN_PREP_PROCESSES", "1"),
    ("KILN_WORKER_CONCURRENCY", "8"),
    ("KILN_DB_POOL_SIZE", "4"),
    ("KILN_DB_MAX_OVERFLOW", "8"),
)


IDLE_GETS = 50  # polls of the job before its chunks are sent


def database_dsn(sqlalchemy_url: str) -> str:
    """libpq's form of Kiln's SQLAlchemy URL."""
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


def create_big_job(
    dsn: str,
    *,
    tenant: str,
    model_ref: str,
    total: int,
    chunk_size: int,
    inputs: Sequence[str],
    queue: str = BULK,
) -> str:
    """A job of `total` pending items, written with COPY in one transaction, as `submit_job`
    would record it (without sending anything); item `i` reads `inputs[i % len(inputs)]`.
    Returns the job's id."""
    job_id = str(uuid.uuid4())
    with psycopg.connect(dsn) as conn:  # one transaction, committed when the block ends
        conn.execute(
            "INSERT INTO jobs (id, tenant, model, status, options, chunk_count, queue, created_at)"
            " VALUES (%s, %s, %s, 'queued', '{}', %s, %s, now())",
            (job_id, tenant, model_ref, math.ceil(total / chunk_size), queue),
        )
        _copy_items(conn, job_id, total, chunk_size, inputs)
        seed_counters(conn, job_id, total)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE items")  # plans as on a database autovacuum has seen since
    return job_id


def _copy_items(
    conn: psycopg.Connection[Any],
    job_id: str,
    total: int,
    chunk_size: int,
    inputs: Sequence[str],
) -> None:
    columns = "job_id, key, source, chunk, status, attempts, queued_at"
    with conn.cursor() as cursor:
        now = cursor.execute("SELECT now()::text").fetchone()
        assert now is not None
        with cursor.copy(f"COPY items ({columns}) FROM STDIN") as copy:
            for start in range(0, total, COPY_ROWS):
                lines = [
                    f"{job_id}\titem-{i:08d}\t{inputs[i % len(inputs)]}\t{i // chunk_size}"
                    f"\tpending\t0\t{now[0]}\n"
                    for i in range(start, min(total, start + COPY_ROWS))
                ]
                copy.write("".join(lines))


def seed_counters(conn: psycopg.Connection[Any], job_id: str, total: int) -> None:
    """The job's row in `job_counters` where the schema has that table (its total in slot 0,
    as `submit_job` writes it); nothing where it has not."""
    found = conn.execute("SELECT to_regclass('job_counters')").fetchone()
    if found is None or found[0] is None:
        return
    conn.execute(
        "INSERT INTO job_counters (job_id, slot, total) VALUES (%s, 0, %s)", (job_id, total)
    )


def chunk_item_ids(dsn: str, job_id: str, chunks: int) -> dict[int, list[int]]:
    """The items' ids of the job's first `chunks` chunks, as a chunk message lists them."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT chunk, array_agg(id ORDER BY id) FROM items"
            " WHERE job_id = %s AND chunk < %s GROUP BY chunk ORDER BY chunk",
            (job_id, chunks),
        ).fetchall()
    return {int(chunk): list(ids) for chunk, ids in rows}


def send_chunks(stack: Stack, job_id: str, chunks: dict[int, list[int]]) -> None:
    producer = make_producer(stack.settings)
    try:
        dispatcher = CeleryDispatcher(producer)
        for chunk, ids in chunks.items():
            dispatcher.enqueue_chunk(job_id, chunk, ids, BULK)
    finally:
        producer.close()


def put_inputs(stack: Stack, files: Sequence[Path], prefix: str = "bench/bigjob") -> list[str]:
    """Put `files` into the deployment's own store once (as `prefix/NAME`); their `store:`
    sources, in order."""
    store = open_store(stack.settings)
    keys = [f"{prefix}/{path.name}" for path in files]
    for key, path in zip(keys, files, strict=True):
        store.put(key, path.read_bytes(), "image/jpeg")
    return [sources.in_store(key) for key in keys]


def model_ref(stack: Stack, name: str) -> str:
    engine = make_engine(stack.settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            return get_model(session, name, TENANT).ref
    finally:
        engine.dispose()


@dataclass
class LockSamples:
    """What the sampler saw of the workers' Postgres backends."""

    samples: int = 0
    with_wait: int = 0  # samples in which some worker backend waited on a lock
    on_job_row: int = 0  # … waited on the job row (`SELECT … FROM jobs … FOR UPDATE`)
    active: int = 0  # backend-samples running a statement
    waiting: int = 0  # backend-samples waiting on a lock
    statements: Counter[str] = field(default_factory=Counter)  # what the waiters ran

    def summary(self) -> dict[str, Any]:
        n = self.samples or 1
        return {
            "lock_samples": self.samples,
            "lock_wait_share": round(self.with_wait / n, 4),
            "job_row_wait_share": round(self.on_job_row / n, 4),
            "lock_wait_backend_share": round(self.waiting / self.active, 4) if self.active else 0,
            "lock_waits_by_statement": dict(self.statements),
        }


SAMPLE_SQL = """
SELECT wait_event_type = 'Lock', state = 'active', left(query, 300)
FROM pg_stat_activity WHERE application_name LIKE %s
"""


def _statement(query: str) -> str:
    """What a waiting backend ran, in a word or three ("job row FOR UPDATE", "insert items")."""
    words = query.lower().split()
    text = " ".join(words)
    if "from jobs" in text and "for update" in text:
        return "job row FOR UPDATE"
    for table in ("job_counters", "items", "jobs"):
        if table in words:
            return f"{words[0]} {table}"
    return "other"


@contextmanager
def lock_sampler(dsn: str, app_prefix: str) -> Iterator[LockSamples]:
    """Sample the backends whose application_name starts with `app_prefix` every 50 ms."""
    seen = LockSamples()
    stop = threading.Event()

    def loop() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.wait(LOCK_SAMPLE_S):
                rows = conn.execute(SAMPLE_SQL, (app_prefix + "%",)).fetchall()
                waiting = [query for lock, _active, query in rows if lock]
                seen.samples += 1
                seen.active += sum(1 for _lock, active, _q in rows if active)
                seen.waiting += len(waiting)
                seen.with_wait += bool(waiting)
                kinds = [_statement(q or "") for q in waiting]
                seen.on_job_row += "job row FOR UPDATE" in kinds
                seen.statements.update(kinds)

    sampler = threading.Thread(target=loop, name="bench-locks", daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        stop.set()
        sampler.join()


@dataclass(frozen=True)
class Poll:
    at: float  # perf_counter when the answer came
    ms: float
    finished: int  # succeeded + failed, as the answer said


def get_job(http: httpx.Client, job_id: str) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = http.get(f"/v1/jobs/{job_id}")
    ms = 1000 * (time.perf_counter() - started)
    response.raise_for_status()
    return ms, response.json()


def _finished(job: dict[str, Any]) -> int:
    return int(job["counts"]["succeeded"]) + int(job["counts"]["failed"])


def wait_warm(http: httpx.Client, job_id: str, items: int) -> None:
    """Until `items` have finished (every worker has loaded the model), or WARM_S."""
    deadline = time.monotonic() + WARM_S
    while time.monotonic() < deadline:
        if _finished(get_job(http, job_id)[1]) >= items:
            return
        time.sleep(0.1)


def poll(http: httpx.Client, job_id: str, seconds: float, until_finished: int) -> list[Poll]:
    """GET the job back to back for `seconds`, or until `until_finished` items are done."""
    polls: list[Poll] = []
    deadline = time.perf_counter() + seconds
    while len(polls) < 2 or time.perf_counter() < deadline:
        ms, job = get_job(http, job_id)
        polls.append(Poll(time.perf_counter(), ms, _finished(job)))
        if polls[-1].finished >= until_finished and len(polls) >= 2:
            break
        time.sleep(POLL_PAUSE_S)
    return polls


DOWNLOAD_ROWS = 2000  # rows per synthetic shard
LABELS_TYPE = pa.list_(pa.struct([("label", pa.string()), ("score", pa.float32())]))


def results_download(stack: Stack, job_id: str, rows: int) -> dict[str, Any]:
    """API RSS while the whole job's results download: `rows` result rows are written as
    synthetic shards (beyond the chunks the workers ran) into Kiln's local store, then
    `GET /v1/jobs/{id}/results` is read to the end while the API's RSS is sampled."""
    shards = max(1, rows // DOWNLOAD_ROWS)
    place = results.Place(open_store(stack.settings), results.results_prefix(job_id))
    outputs = {"labels": [{"label": "a", "score": 0.5}]}
    fields = [pa.field("labels", LABELS_TYPE)]
    for shard in range(shards):
        batch = [
            results.ResultRow(f"r{shard}-{i}", "succeeded", None, 1.0, outputs)
            for i in range(DOWNLOAD_ROWS)
        ]
        results.write_shard(place, 1_000_000 + shard, batch, fields)
    api = psutil.Process(stack.api.pid)
    before = api.memory_info().rss
    peak, got, started = before, 0, time.perf_counter()
    with stack.http.stream("GET", f"/v1/jobs/{job_id}/results", timeout=600) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            got += len(piece)
            peak = max(peak, api.memory_info().rss)
    mb = 1024 * 1024
    return {
        "download_rows": shards * DOWNLOAD_ROWS,
        "download_mb": round(got / mb, 1),
        "download_s": round(time.perf_counter() - started, 1),
        "api_rss_before_mb": round(before / mb),
        "api_rss_peak_mb": round(peak / mb),
    }


def run(ctx: Context) -> CaseResult:
    plan = ctx.plan
    layout = Layout(
        name="bigjob",
        workers=plan.bigjob_workers,
        worker_env=WORKER_ENV,
        storage="local",
    )
    parent = ctx.require_stack()
    with local_deployment(parent, ctx.log_dir, dict(plan.kiln_env), layout) as stack:
        stack.register(ctx.models[MODEL], ctx.workdir)
        side = plan.ceiling_size
        folder = ctx.workdir / "images" / f"{side[0]}x{side[1]}-n{INPUTS}"
        inputs = put_inputs(stack, make_images(folder, INPUTS, side))
        return _measure(ctx, stack, inputs)


def _measure(ctx: Context, stack: Stack, inputs: list[str]) -> CaseResult:
    plan, chunk_size = ctx.plan, stack.settings.chunk_size
    dsn = database_dsn(stack.settings.database_url)
    started = time.perf_counter()
    job_id = create_big_job(
        dsn,
        tenant=TENANT,
        model_ref=model_ref(stack, MODEL),
        total=plan.bigjob_items,
        chunk_size=chunk_size,
        inputs=inputs,
    )
    create_s = time.perf_counter() - started
    # The GET alone, before any worker runs: what the job's size costs a poll, apart from the
    # CPU the workers take from the API once they run on the same cores.
    idle = [get_job(stack.http, job_id)[0] for _ in range(IDLE_GETS)]
    wanted = math.ceil(MAX_RATE * (WARM_S + plan.bigjob_seconds) / chunk_size)
    chunks = chunk_item_ids(dsn, job_id, wanted)
    sent_items = sum(len(ids) for ids in chunks.values())
    send_chunks(stack, job_id, chunks)
    wait_warm(stack.http, job_id, min(sent_items // 10, 2 * chunk_size * len(stack.workers)))
    app_prefix = f"kiln-bench-{Layout(name='bigjob').process('worker')}"
    with meter(stack).window() as usage, lock_sampler(dsn, app_prefix) as locks:
        polls = poll(stack.http, job_id, plan.bigjob_seconds, sent_items)
    span = polls[-1].at - polls[0].at
    done = polls[-1].finished - polls[0].finished
    extra: dict[str, Any] = {
        "job_items": plan.bigjob_items,
        "create_s": round(create_s, 1),
        "sent_chunks": len(chunks),
        "sent_items": sent_items,
        "workers": len(stack.workers),
        "gets": len(polls),
        "idle_get_ms": percentiles(idle),
        "items_finished_per_s": round(done / span, 1) if span > 0 else None,
        **locks.summary(),
        **results_download(stack, job_id, plan.bigjob_items),
    }
    result = CaseResult.from_usage(
        "bigjob", MODEL, done, usage, latency_ms=percentiles([p.ms for p in polls]), extra=extra
    )
    result.seconds = round(span, 3)  # items/s over the polls that counted them; CPU: the window
    return result
