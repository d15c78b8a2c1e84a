"""Kiln on real services for the benchmark: Postgres, Redis, moto S3, `kiln api`, `kiln worker`.

Built from the same launchers the integration tests use (devstack/services.py), so both run
Kiln the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devstack.services import (
    Process,
    backing_services,
    create_api_key,
    free_port,
    service_env,
    settings_for,
    start_api,
    start_worker,
)
from kiln.app.catalog import register_model
from kiln.app.core.config import Settings
from kiln.app.db.migrate import upgrade
from kiln.app.db.session import make_engine, make_session_factory
from kiln.app.model_spec import ImageModelSpec
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


@contextmanager
def kiln_stack(log_dir: Path, worker_env: dict[str, str] | None = None) -> Iterator[Stack]:
    """Start everything; tear it all down (database and Redis index included) on exit."""
    with ExitStack() as stack:
        backing = stack.enter_context(
            backing_services(log_dir, (BUCKET, SOURCE_BUCKET), db_prefix="kiln_bench")
        )
        kiln_vars = backing.kiln_env(
            log_dir / "kiln-data",
            f"s3://{BUCKET}/kiln",
            max_files_per_job="1000000",
            # One tenant drives every client: its limits stay on (their cost is measured) but
            # never refuse the load.
            tenant_rate_limit="1000000/second",
            tenant_max_open_jobs="1000000",
        )
        kiln_vars |= worker_env or {}
        settings = settings_for(kiln_vars)
        upgrade(settings)
        env = service_env(kiln_vars)
        api, api_url = start_api(env, log_dir)
        stack.callback(api.stop)
        port = free_port()
        worker, _node = start_worker(env, log_dir, "--metrics-port", str(port), node_prefix="bench")
        stack.callback(worker.stop)
        key = create_api_key(settings, "bench", (BUCKET, SOURCE_BUCKET))
        headers = {"Authorization": f"Bearer {key}"}
        http = stack.enter_context(httpx.Client(base_url=api_url, headers=headers, timeout=120))
        yield Stack(
            settings=settings,
            env=env,
            s3=backing.s3,
            s3_endpoint=backing.s3_endpoint,
            moto=backing.moto,
            api=api,
            worker=worker,
            api_url=api_url,
            metrics_url=f"http://127.0.0.1:{port}/metrics",
            http=http,
            redis_url=backing.broker_url,
        )
