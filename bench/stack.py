"""Kiln on real services for the benchmark: Postgres, Redis, moto S3, `kiln api`, `kiln worker`.

Built from the same launchers the integration tests use, so both run Kiln the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.services import (
    AWS_ENV,
    Process,
    claim_redis_db,
    create_database,
    drop_database,
    free_port,
    release_redis_db,
    service_env,
    start_api,
    start_moto,
    start_worker,
)
from kiln.app.auth import create_key
from kiln.app.catalog import register_model
from kiln.app.core.config import Settings, get_settings
from kiln.app.db.migrate import upgrade
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.model_spec import ImageModelSpec
from kiln.app.storage import open_store
from kiln.app.tenants import allow_bucket
from kiln.workers.celery.app import make_celery

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

    @property
    def kiln_pids(self) -> list[int]:
        return [self.api.pid, self.worker.pid]

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
        """Per model: batches and rows run so far, from the worker's Prometheus endpoint."""
        text = httpx.get(self.metrics_url, timeout=10).text
        stats: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                model = sample.labels.get("model")
                if model is None:
                    continue
                if sample.name == "kiln_batch_size_count":
                    stats.setdefault(model, {})["batches"] = sample.value
                elif sample.name == "kiln_batch_size_sum":
                    stats.setdefault(model, {})["rows"] = sample.value
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


def _api_key(settings: Settings) -> str:
    engine = make_engine(settings.database_url)
    try:
        with make_session_factory(engine)() as session:
            key = create_key(session, "bench")
            for bucket in (BUCKET, SOURCE_BUCKET):
                allow_bucket(session, "bench", bucket)
            session.commit()
            return key.secret
    finally:
        engine.dispose()


@contextmanager
def kiln_stack(log_dir: Path, worker_env: dict[str, str] | None = None) -> Iterator[Stack]:
    """Start everything; tear it all down (database and Redis index included) on exit."""
    with ExitStack() as stack:
        for key, value in AWS_ENV.items():  # boto3 in this process talks to moto too
            os.environ.setdefault(key, value)
        database_url = create_database(prefix="kiln_bench")
        stack.callback(drop_database, database_url)
        redis_url = claim_redis_db()
        stack.callback(release_redis_db, redis_url)
        moto, s3_endpoint = start_moto(log_dir)
        stack.callback(moto.stop)
        s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
        for bucket in (BUCKET, SOURCE_BUCKET):
            s3.create_bucket(Bucket=bucket)
        kiln_vars = {
            "KILN_DATA_DIR": str(log_dir / "kiln-data"),
            "KILN_DATABASE_URL": database_url,
            "KILN_BROKER_URL": redis_url,
            "KILN_STORAGE_URL": f"s3://{BUCKET}/kiln",
            "KILN_S3_ENDPOINT_URL": s3_endpoint,
            "KILN_MAX_FILES_PER_JOB": "1000000",
            # One tenant drives every client: its limits stay on (their cost is measured) but
            # never refuse the load.
            "KILN_TENANT_RATE_LIMIT": "1000000/second",
            "KILN_TENANT_MAX_OPEN_JOBS": "1000000",
            **(worker_env or {}),
        }
        settings = get_settings(
            **{k.removeprefix("KILN_").lower(): v for k, v in kiln_vars.items()}
        )
        upgrade(settings)
        env = service_env(kiln_vars)
        api, api_url = start_api(env, log_dir)
        stack.callback(api.stop)
        celery = make_celery(settings)
        stack.callback(celery.close)
        port = free_port()
        worker, _node = start_worker(
            env,
            log_dir,
            lambda node: bool(celery.control.ping([node], timeout=1.0)),
            "--metrics-port",
            str(port),
            node_prefix="bench",
        )
        stack.callback(worker.stop)
        headers = {"Authorization": f"Bearer {_api_key(settings)}"}
        http = stack.enter_context(httpx.Client(base_url=api_url, headers=headers, timeout=120))
        yield Stack(
            settings=settings,
            env=env,
            s3=s3,
            s3_endpoint=s3_endpoint,
            moto=moto,
            api=api,
            worker=worker,
            api_url=api_url,
            metrics_url=f"http://127.0.0.1:{port}/metrics",
            http=http,
            redis_url=redis_url,
        )
