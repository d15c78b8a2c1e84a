"""Daft, the multimodal dataframe: list the same S3 bucket and prefix as the `ray` case →
download → a class UDF holding one ONNX Runtime session, in batches of 16, decoding and
resizing as the plain loop does → Parquet.

Start-up is excluded: the pipeline runs twice in one process and the second run is timed, so
importing Daft, its runner's start and the first S3 connections fall outside the window; they
are reported apart in `extra` (`import_s`, `first_run_s`). Daft builds its class UDF's instances
again for each query, so the second run loads the ONNX Runtime session again, inside the window:
`model_load_in_window_s` says how long that took.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort

from bench.cases.loop import finish, prepare
from bench.measure import Meter
from bench.results import CaseResult

BATCH = 16  # as the `ray` case


def _pipeline(args: dict[str, Any], out: str, loads: str) -> int:
    import daft
    from daft import DataType
    from daft.io import IOConfig, S3Config

    endpoint = urlparse(args["s3_endpoint"])
    io_config = IOConfig(
        s3=S3Config(
            endpoint_url=f"{endpoint.scheme}://{endpoint.netloc}",
            key_id=os.environ["AWS_ACCESS_KEY_ID"],  # moto's, from the bench environment
            access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
            force_virtual_addressing=False,
        )
    )
    kind = str(args.get("preprocess", "crop"))
    # Classifiers answer their top class; the detector its boxes (as JSON text).
    dtype = DataType.int64() if kind == "crop" else DataType.string()

    @daft.cls
    class Predictor:
        def __init__(self, onnx: str, size: int) -> None:
            started = time.perf_counter()
            options = ort.SessionOptions()
            options.intra_op_num_threads = os.cpu_count() or 1
            self.session = ort.InferenceSession(onnx, options, providers=["CPUExecutionProvider"])
            self.name = self.session.get_inputs()[0].name
            self.size = size
            took = time.perf_counter() - started
            Path(loads, f"{os.getpid()}-{id(self)}").write_text(str(took))

        @daft.method.batch(return_dtype=dtype, batch_size=BATCH)  # type: ignore[untyped-decorator]
        def __call__(self, images: Any) -> Any:
            prepared = [prepare(kind, b, self.size) for b in images]
            out = self.session.run(None, {self.name: np.concatenate([p[0] for p in prepared])})[0]
            if kind == "crop":
                return np.asarray(out.argmax(axis=1), dtype=np.int64)
            metas = [p[1] for p in prepared]
            return [json.dumps(finish(kind, row, m)) for row, m in zip(out, metas, strict=True)]

    predict = Predictor(args["onnx"], int(args["size"]))
    df = daft.from_glob_path(f"s3://{args['prefix']}/*", io_config=io_config)
    df = df.with_column("bytes", df["path"].download(io_config=io_config))
    df = df.with_column("answer", predict(df["bytes"]))
    df.select("path", "answer").write_parquet(out)
    return int(daft.read_parquet(out).count_rows())


def _load_seconds(folder: str) -> float:
    return round(sum(float(p.read_text()) for p in Path(folder).iterdir()), 3)


def measure(args: dict[str, Any]) -> CaseResult:
    started = time.perf_counter()
    try:
        import daft  # noqa: F401
    except ImportError:
        return CaseResult.skip(
            "daft", args["model"], "Daft is not installed: pip install -e '.[bench]'"
        )
    import_s = time.perf_counter() - started
    started = time.perf_counter()
    _pipeline(args, tempfile.mkdtemp(prefix="bench-daft-warm-"), tempfile.mkdtemp())
    first_run_s = time.perf_counter() - started
    out, loads = tempfile.mkdtemp(prefix="bench-daft-"), tempfile.mkdtemp(prefix="bench-daft-up-")
    with Meter({"subject": [os.getpid()]}).window() as usage:
        written = _pipeline(args, out, loads)
    if written != int(args["items"]):
        raise RuntimeError(f"Daft wrote {written} rows for {args['items']} images")
    extra = {
        "excludes": "start-up: importing Daft and a first run of the pipeline",
        "import_s": round(import_s, 3),
        "first_run_s": round(first_run_s, 3),
        "model_load_in_window_s": _load_seconds(loads),
        "udf_instances": len(list(Path(loads).iterdir())),
    }
    return CaseResult.from_usage("daft", args["model"], written, usage, extra=extra)


def run(ctx: Any, model: str) -> CaseResult:
    from bench.cases.ray_data import child_args
    from bench.child import run_child

    return run_child("daft_case", child_args(ctx, model), ctx.log_dir)
