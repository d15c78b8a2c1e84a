"""Naive Celery: one task per image, model loaded once per worker process, no batching.

What most teams write first: a prefork worker with one process per core, each running the
model at batch size 1 with ONNX Runtime's default settings, results in Redis's result backend.
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any

import boto3
import numpy as np
import onnxruntime as ort
from celery import Celery, group
from celery.signals import worker_process_init

from bench.cases.loop import preprocess
from bench.cases.services import meter
from bench.context import Context
from bench.results import CaseResult
from devstack.services import Process, wait_for

TASK, QUEUE = "naive.classify", "naive"


def make_app(broker: str) -> Celery:
    app = Celery("naive", broker=broker, backend=broker, set_as_current=False)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    held: dict[str, Any] = {}

    def load(**_kwargs: Any) -> None:  # in each forked worker process, once
        held["session"] = ort.InferenceSession(
            os.environ["NAIVE_ONNX"], providers=["CPUExecutionProvider"]
        )
        held["s3"] = boto3.client("s3", endpoint_url=os.environ["NAIVE_S3_ENDPOINT"])

    worker_process_init.connect(load, weak=False)

    @app.task(name=TASK, shared=False)  # type: ignore[untyped-decorator]
    def classify(uri: str) -> list[list[float]]:
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        data = held["s3"].get_object(Bucket=bucket, Key=key)["Body"].read()
        x = preprocess(io.BytesIO(data), int(os.environ["NAIVE_SIZE"]))
        session = held["session"]
        logits = session.run(None, {session.get_inputs()[0].name: x})[0][0]
        best = np.argsort(-logits)[:5]
        return [[int(i), float(logits[i])] for i in best]

    return app


def main() -> None:
    app = make_app(os.environ["NAIVE_BROKER"])
    app.worker_main(
        [
            "worker",
            "--pool",
            "prefork",
            "-c",
            str(os.cpu_count() or 1),
            "-Q",
            QUEUE,
            "-n",
            "naive@localhost",
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
        ]
    )


def run(ctx: Context, model: str) -> CaseResult:
    stack = ctx.require_stack()
    info = ctx.models[model]
    env = {
        **stack.env,
        "NAIVE_BROKER": stack.redis_url,
        "NAIVE_ONNX": str(info.onnx),
        "NAIVE_SIZE": str(info.input_size),
        "NAIVE_S3_ENDPOINT": stack.s3_endpoint,
    }
    worker = Process(
        f"naive-celery-{model}",
        [sys.executable, "-m", "bench.cases.naive_celery"],
        env,
        ctx.log_dir,
    )
    app = make_app(stack.redis_url)
    try:
        wait_for(
            lambda: bool(app.control.ping(["naive@localhost"], timeout=1.0)),
            60,
            "naive celery worker",
            interval=0.5,
        )
        uris = ctx.uris["images"]
        _classify(app, uris[: min(len(uris), 8)])  # warm-up: every process has loaded its model
        with meter(stack, subject=[worker.pid]).window() as usage:
            results = _classify(app, uris)
        if len(results) != len(uris) or not all(results):
            raise RuntimeError(f"naive celery returned {len(results)} results for {len(uris)}")
        return CaseResult.from_usage("naive-celery", model, len(uris), usage)
    finally:
        app.close()
        worker.stop()


def _classify(app: Celery, uris: list[str]) -> list[Any]:
    tasks = group(app.signature(TASK, args=[uri], queue=QUEUE) for uri in uris)
    return list(tasks.apply_async().get(timeout=3600, disable_sync_subtasks=False))


if __name__ == "__main__":
    main()
