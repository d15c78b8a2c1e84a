"""Kiln on real services for the benchmark: Postgres, Redis, moto S3, `kiln api`, `kiln worker`.

Built from the same launchers the integration tests use (devstack/services.py), so both run
Kiln the same way. `kiln_stack` is the main one (Kiln's store in moto S3); a case that needs
Kiln on local storage, or several workers, starts a `local_deployment` beside it.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.services import (
    Process,
    backing_services,
    claim_redis_db,
    create_api_key,
    create_database,
    drop_database,
    free_port,
    kiln_env,
    release_redis_db,
    service_env,
    settings_for,
    start_api,
    start_worker,
)
from kiln.app.catalog.catalog import register_model
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.db.migrate import upgrade
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.storage import open_store

BUCKET = "kiln-bench"
SOURCE_BUCKET = "kiln-bench-sources"
CLOSED = {"completed", "failed", "cancelled"}


@dataclass(frozen=True)
class Registered:
    name: str
    onnx: Path
    input_size: int
    labels: list[str]


@dataclass
class Stack:
    settings: Settings
    env: dict[str, str]
    s3: Any
    s3_endpoint: str
    moto: Process
    api: Process
    worker: Process
    api_url: str
    metrics_url: str
    http: httpx.Client
    redis_url: str
    extra_workers: list[Process] = field(default_factory=list)
    extra_metrics_urls: list[str] = field(default_factory=list)
    storage: str = "s3"  # where Kiln's own store is: "s3" (moto) or "local" (file://)

    @property
    def workers(self) -> list[Process]:
        return [self.worker, *self.extra_workers]

    @property
    def kiln_pids(self) -> list[int]:
        return [self.api.pid, *(w.pid for w in self.workers)]

    def upload(self, prefix: str, files: Sequence[Path]) -> list[str]:
        """Put `files` into the source bucket (in parallel); their s3:// URIs, in order."""

        def put(path: Path) -> str:
            key = f"{prefix}/{path.name}"
            self.s3.put_object(Bucket=SOURCE_BUCKET, Key=key, Body=path.read_bytes())
            return f"s3://{SOURCE_BUCKET}/{key}"

        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(put, files))

    def submit(self, model: str, uris: Sequence[str]) -> str:
        return self.submit_inputs(model, [{"uri": u} for u in uris])

    def submit_inputs(self, model: str, inputs: Sequence[dict[str, Any]]) -> str:
        body = {"model": model, "inputs": list(inputs)}
        response = self.http.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
        return str(response.json()["id"])

    def wait(self, job_id: str, timeout: float = 1800, interval: float = 0.1) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job: dict[str, Any] = self.http.get(f"/v1/jobs/{job_id}").json()
            if job["status"] in CLOSED:
                return job
            time.sleep(interval)
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s")

    def batch_stats(self) -> dict[str, dict[str, float]]:
        """Per model: batches and rows run so far, from the workers' Prometheus endpoints."""
        stats: dict[str, dict[str, float]] = {}
        for url in [self.metrics_url, *self.extra_metrics_urls]:
            text = httpx.get(url, timeout=10).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    model = sample.labels.get("model")
                    if model is None:
                        continue
                    totals = stats.setdefault(model, {})
                    if sample.name == "kiln_batch_size_count":
                        totals["batches"] = totals.get("batches", 0) + sample.value
                    elif sample.name == "kiln_batch_size_sum":
                        totals["rows"] = totals.get("rows", 0) + sample.value
        return stats

    def register(self, model: Registered, workdir: Path, kind: str = "classify") -> None:
        labels = workdir / f"{model.name}.labels.txt"
        labels.write_text("\n".join(model.labels) + "\n")
        spec = ImageModelSpec(input_size=model.input_size, labels=model.labels)
        engine = make_engine(self.settings.database_url)
        try:
            with make_session_factory(engine)() as session:
                register_model(
                    session,
                    open_store(self.settings),
                    tenant="",
                    name=model.name,
                    data=model.onnx.read_bytes(),
                    kind=kind,
                    spec=spec,
                )
                session.commit()
        finally:
            engine.dispose()


# One tenant drives every client: its limits stay on (their cost is measured) but never refuse
# the load.
LIMITS = {
    "max_files_per_job": "1000000",
    "tenant_rate_limit": "1000000/second",
    "tenant_max_open_jobs": "1000000",
}


@contextmanager
def kiln_stack(log_dir: Path, worker_env: dict[str, str] | None = None) -> Iterator[Stack]:
    """Start everything; tear it all down (database and Redis index included) on exit."""
    with ExitStack() as stack:
        backing = stack.enter_context(
            backing_services(log_dir, (BUCKET, SOURCE_BUCKET), db_prefix="kiln_bench")
        )
        kiln_vars = backing.kiln_env(log_dir / "kiln-data", f"s3://{BUCKET}/kiln", **LIMITS)
        kiln_vars |= worker_env or {}
        yield _start_kiln(
            stack, kiln_vars, log_dir, backing.s3, backing.moto, backing.broker_url, Layout()
        )


@dataclass(frozen=True)
class Layout:
    """Which Kiln processes a deployment runs, and under which names (logs, PGAPPNAME)."""

    name: str = ""  # "" for the main stack: its processes keep the names `api` and `worker`
    workers: int = 1
    worker_env: tuple[tuple[str, str], ...] = ()  # only for the workers, beside the common env
    storage: str = "s3"

    def process(self, role: str, index: int = 0) -> str:
        base = f"{role}-{self.name}" if self.name else role
        return f"{base}-{index}" if index else base


@contextmanager
def local_deployment(
    parent: Stack, log_dir: Path, kiln_settings: dict[str, str], layout: Layout
) -> Iterator[Stack]:
    """Another Kiln beside `parent`, on local storage (`KILN_STORAGE_URL=file://…`) as a user
    without S3 runs it: its own database, Redis index and store folder, its own API and
    `layout.workers` workers; all removed on exit. moto keeps running (the parent's) but no
    object of this deployment is in it."""
    with ExitStack() as stack:
        database_url = create_database(prefix="kiln_bench")
        stack.callback(drop_database, database_url)
        broker_url = claim_redis_db()
        stack.callback(release_redis_db, broker_url)
        store = log_dir / f"store-{layout.name}"
        shutil.rmtree(store, ignore_errors=True)  # a crashed run's leftovers
        stack.callback(shutil.rmtree, store, True)
        kiln_vars = kiln_env(
            data_dir=log_dir / f"kiln-data-{layout.name}",
            database_url=database_url,
            broker_url=broker_url,
            storage_url=store.as_uri(),
            s3_endpoint=parent.s3_endpoint,
            **LIMITS,
        )
        kiln_vars |= kiln_settings
        yield _start_kiln(stack, kiln_vars, log_dir, parent.s3, parent.moto, broker_url, layout)


def _start_kiln(
    stack: ExitStack,
    kiln_vars: dict[str, str],
    log_dir: Path,
    s3: Any,
    moto: Process,
    broker_url: str,
    layout: Layout,
) -> Stack:
    """Migrate the database, start the API and the workers (stopped when `stack` closes)."""
    settings = settings_for(kiln_vars)
    upgrade(settings)
    env = service_env(kiln_vars)
    # PGAPPNAME names each process's Postgres backends, so a case can tell them apart.
    api, api_url = start_api(
        {**env, "PGAPPNAME": f"kiln-bench-{layout.process('api')}"}, log_dir, layout.process("api")
    )
    stack.callback(api.stop)
    ports = [free_port() for _ in range(layout.workers)]

    def worker(index: int) -> Process:
        name = layout.process("worker", index)
        worker_env = {**env, **dict(layout.worker_env), "PGAPPNAME": f"kiln-bench-{name}"}
        port = str(ports[index])
        proc, _node = start_worker(
            worker_env, log_dir, "--metrics-port", port, name=name, node_prefix="bench"
        )
        return proc

    with ThreadPoolExecutor(layout.workers) as pool:  # each start waits for its worker's ping
        futures = [pool.submit(worker, index) for index in range(layout.workers)]
    started: list[Process] = []
    for future in futures:  # every started worker is stopped on exit, even if another failed
        with contextlib.suppress(Exception):
            started.append(future.result())
    stack.callback(_stop_together, started)
    workers = [future.result() for future in futures]
    key = create_api_key(settings, "bench", (BUCKET, SOURCE_BUCKET))
    headers = {"Authorization": f"Bearer {key}"}
    http = stack.enter_context(httpx.Client(base_url=api_url, headers=headers, timeout=120))
    return Stack(
        settings=settings,
        env=env,
        s3=s3,
        s3_endpoint=settings.s3_endpoint_url or "",
        moto=moto,
        api=api,
        worker=workers[0],
        api_url=api_url,
        metrics_url=f"http://127.0.0.1:{ports[0]}/metrics",
        http=http,
        redis_url=broker_url,
        extra_workers=workers[1:],
        extra_metrics_urls=[f"http://127.0.0.1:{p}/metrics" for p in ports[1:]],
        storage=layout.storage,
    )


def _stop_together(procs: list[Process]) -> None:
    """Stop `procs` at once: each worker's graceful shutdown takes a second or more, and
    one after another they added up to most of a deployment's tear-down."""
    if len(procs) < 2:
        for proc in procs:
            proc.stop()
        return
    with ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda proc: proc.stop(), procs))
