"""Ray Data: `read_binary_files` from the same S3 bucket → `map_batches` with an ONNX Runtime
actor pool → Parquet, the way its docs recommend for batch inference.

On 2 cores each actor asks for a fractional CPU: actors holding whole CPUs starve the read
tasks and the pipeline hangs.

Start-up is excluded, as for every case: `ray.init`, then the same pipeline over a few images
(so the read and write tasks find warm Ray workers, as in a long-running cluster), and then
Ray Data's `DataContext.wait_for_min_actors_s` makes the timed pipeline start its whole actor
pool (processes, imports, one ONNX Runtime session each) before any block is read. Each actor
marks the end of its constructor with a file; the window opens when all have, and closes when
the Parquet write returns. `extra` says how long each excluded part took.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort
import psutil

from bench.cases.loop import finish, prepare
from bench.measure import Meter, Usage
from bench.models import preprocessing
from bench.results import CaseResult

BATCH = 16
WARM_UP = 32  # images through the whole pipeline first, so Ray has warm task workers
ACTOR_START_LIMIT_S = 600  # Ray Data raises if the pool is not up by then


class Predictor:
    def __init__(self, onnx: str, size: int, kind: str, ready_dir: str) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one actor per core
        self.session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
        self.name = self.session.get_inputs()[0].name
        self.size, self.kind = size, kind
        Path(ready_dir, str(os.getpid())).touch()  # this actor is started

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prepared = [prepare(self.kind, bytes(b), self.size) for b in batch["bytes"]]
        x = np.concatenate([p[0] for p in prepared])
        out = self.session.run(None, {self.name: x})[0]
        if self.kind == "crop":
            return {"path": batch["path"], "top1": out.argmax(axis=1)}
        metas = [p[1] for p in prepared]
        boxes = [json.dumps(finish(self.kind, row, m)) for row, m in zip(out, metas, strict=True)]
        return {"path": batch["path"], "detections": np.array(boxes, dtype=object)}


class WindowWhenReady:
    """Opens `meter`'s window from a thread once `count` files are in `ready_dir` (every
    actor started), and closes it on `close()`: the pipeline's start-up stays outside."""

    def __init__(self, meter: Meter, ready_dir: str, count: int) -> None:
        self.meter, self.ready_dir, self.count = meter, ready_dir, count
        self.done = threading.Event()
        self.opened_at: float | None = None
        self.usage: Usage | None = None
        self.thread = threading.Thread(target=self._watch, name="bench-ray-ready", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while sum(1 for _ in Path(self.ready_dir).iterdir()) < self.count:
            if self.done.wait(0.005):
                return
        self.opened_at = time.perf_counter()
        with self.meter.window() as usage:
            self.done.wait()
        self.usage = usage

    def close(self) -> Usage:
        self.done.set()
        self.thread.join()
        if self.usage is None:
            raise RuntimeError("the pipeline ended before its actors had all started")
        return self.usage


def _start_ray(cores: int) -> tuple[float, list[int]]:
    """`ray.init`: its seconds, and the pids of the daemons it starts (they detach from this
    process, so they are counted by pid, with the workers and actors they start)."""
    import ray

    before = set(psutil.pids())
    started = time.perf_counter()
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
    init_s = time.perf_counter() - started
    # The actor pool starts whole before any block is read (see the module's docstring).
    ray.data.DataContext.get_current().wait_for_min_actors_s = ACTOR_START_LIMIT_S
    return init_s, [pid for pid in psutil.pids() if pid not in before]


def _pipeline(args: dict[str, Any], paths: str | list[str], ready_dir: str) -> Any:
    import ray
    from pyarrow import fs

    endpoint = urlparse(args["s3_endpoint"])
    s3 = fs.S3FileSystem(
        endpoint_override=endpoint.netloc,
        scheme=endpoint.scheme,
        region="us-east-1",
        access_key=os.environ["AWS_ACCESS_KEY_ID"],  # moto's, from the bench environment
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    )
    kind = str(args.get("preprocess", "crop"))
    ds = ray.data.read_binary_files(paths, filesystem=s3, include_paths=True)
    return ds.map_batches(
        Predictor,
        fn_constructor_args=(args["onnx"], int(args["size"]), kind, ready_dir),
        batch_size=BATCH,
        batch_format="numpy",
        concurrency=os.cpu_count() or 1,
        num_cpus=0.5,
    )


def measure(args: dict[str, Any]) -> CaseResult:
    try:
        import ray
    except ImportError:
        return CaseResult.skip(
            "ray", args["model"], "Ray is not installed: pip install -e '.[bench]'"
        )
    cores = os.cpu_count() or 1
    init_s, ray_pids = _start_ray(cores)
    started = time.perf_counter()
    if warm := args.get("warm_paths"):
        warm_out = tempfile.mkdtemp(prefix="bench-ray-warm-")
        _pipeline(args, warm, tempfile.mkdtemp()).write_parquet(warm_out)
    warm_s = time.perf_counter() - started
    out, ready_dir = tempfile.mkdtemp(prefix="bench-ray-"), tempfile.mkdtemp(prefix="bench-ray-up-")
    ds = _pipeline(args, args["prefix"], ready_dir)
    window = WindowWhenReady(Meter({"subject": [os.getpid(), *ray_pids]}), ready_dir, cores)
    submitted = time.perf_counter()
    ds.write_parquet(out)
    usage = window.close()
    written = ray.data.read_parquet(out).count()
    ray.shutdown()
    if written != int(args["items"]):
        raise RuntimeError(f"Ray wrote {written} rows for {args['items']} images")
    extra = {
        "excludes": "ray.init, a warm-up run, the actor pool's start (imports, model load)",
        "ray_init_s": round(init_s, 3),
        "warm_up_s": round(warm_s, 3),
        "actor_start_s": round((window.opened_at or submitted) - submitted, 3),
        "actors": cores,
    }
    return CaseResult.from_usage("ray", args["model"], written, usage, extra=extra)


def child_args(ctx: Any, model: str) -> dict[str, Any]:
    """What a peer case's child process needs: the model, the images' S3 prefix in moto."""
    stack = ctx.require_stack()
    info = ctx.models[model]
    first = urlparse(ctx.uris["images"][0])
    return {
        "model": model,
        "onnx": str(info.onnx),
        "size": info.input_size,
        "preprocess": preprocessing(model),
        "items": len(ctx.uris["images"]),
        "s3_endpoint": stack.s3_endpoint,
        "prefix": f"{first.netloc}/{first.path.lstrip('/').rsplit('/', 1)[0]}",
        "warm_paths": [u.removeprefix("s3://") for u in ctx.uris["images"][:WARM_UP]],
    }


def run(ctx: Any, model: str) -> CaseResult:
    from bench.child import run_child

    return run_child("ray_data", child_args(ctx, model), ctx.log_dir)
