"""Ray Data: `read_binary_files` from the same S3 bucket → `map_batches` with an ONNX Runtime
actor pool → Parquet, the way its docs recommend for batch inference.

On 2 cores each actor asks for a fractional CPU: actors holding whole CPUs starve the read
tasks and the pipeline hangs.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort
import psutil

from bench.cases.loop import preprocess
from bench.measure import Meter
from bench.results import CaseResult

BATCH = 16


class Predictor:
    def __init__(self, onnx: str, size: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # one actor per core
        self.session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
        self.name = self.session.get_inputs()[0].name
        self.size = size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = np.concatenate([preprocess(io.BytesIO(b), self.size) for b in batch["bytes"]])
        logits = self.session.run(None, {self.name: x})[0]
        return {"path": batch["path"], "top1": logits.argmax(axis=1)}


def measure(args: dict[str, Any]) -> CaseResult:
    try:
        import ray
        from pyarrow import fs
    except ImportError:
        return CaseResult.skip(
            "ray", args["model"], "Ray is not installed: pip install -e '.[bench]'"
        )
    cores = os.cpu_count() or 1
    before = set(psutil.pids())
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # Ray's daemons detach from this process; count them (and the actors they start) too.
    ray_pids = [pid for pid in psutil.pids() if pid not in before]
    endpoint = urlparse(args["s3_endpoint"])
    s3 = fs.S3FileSystem(
        endpoint_override=endpoint.netloc,
        scheme=endpoint.scheme,
        region="us-east-1",
        access_key=os.environ["AWS_ACCESS_KEY_ID"],  # moto's, from the bench environment
        secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    )
    out = tempfile.mkdtemp(prefix="bench-ray-")
    with Meter({"subject": [os.getpid(), *ray_pids]}).window() as usage:
        ds = ray.data.read_binary_files(args["prefix"], filesystem=s3, include_paths=True)
        ds = ds.map_batches(
            Predictor,
            fn_constructor_args=(args["onnx"], int(args["size"])),
            batch_size=BATCH,
            batch_format="numpy",
            concurrency=cores,
            num_cpus=0.5,
        )
        ds.write_parquet(out)
    written = ray.data.read_parquet(out).count()
    ray.shutdown()
    if written != int(args["items"]):
        raise RuntimeError(f"Ray wrote {written} rows for {args['items']} images")
    return CaseResult.from_usage(
        "ray", args["model"], written, usage, extra={"includes": "actor start-up and model load"}
    )


def run(ctx: Any, model: str) -> CaseResult:
    from bench.child import run_child

    stack = ctx.require_stack()
    info = ctx.models[model]
    first = urlparse(ctx.uris["images"][0])
    args = {
        "model": model,
        "onnx": str(info.onnx),
        "size": info.input_size,
        "items": len(ctx.uris["images"]),
        "s3_endpoint": stack.s3_endpoint,
        "prefix": f"{first.netloc}/{first.path.lstrip('/').rsplit('/', 1)[0]}",
    }
    return run_child("ray_data", args, ctx.log_dir)
