"""Raw engine: ONNX Runtime on pre-decoded tensors at the best batch size — the limit."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.measure import Meter
from bench.results import CaseResult

BATCHES = (1, 4, 8, 16, 32)


def session(path: str, spinning: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def rate(sess: ort.InferenceSession, batch: int, size: int, seconds: float) -> tuple[int, float]:
    """Images run and the wall seconds they took, for at least `seconds`."""
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size), dtype=np.float32)
    name = sess.get_inputs()[0].name
    sess.run(None, {name: x})  # warm-up: first calls allocate
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        sess.run(None, {name: x})
        done += batch
    return done, time.perf_counter() - started


def sweep(
    path: str, size: int, seconds: float, batches: tuple[int, ...] = BATCHES
) -> dict[str, float]:
    rates = {}
    for spinning in (True, False):
        sess = session(path, spinning)
        for batch in batches:
            done, took = rate(sess, batch, size, seconds)
            rates[f"b{batch}-{'spin' if spinning else 'nospin'}"] = round(done / took, 2)
    return rates


def measure(args: dict[str, Any]) -> CaseResult:
    """With `batch`/`spinning`: a short paired run at that setting; else sweep, take the best."""
    path, size, seconds = args["onnx"], int(args["size"]), float(args["seconds"])
    extra: dict[str, Any] = {}
    if "batch" in args:
        batch, spinning = int(args["batch"]), bool(args["spinning"])
    else:
        batches = tuple(int(b) for b in args.get("sweep_batches", BATCHES))
        rates = sweep(path, size, float(args["sweep_seconds"]), batches)
        best = max(rates, key=rates.__getitem__)
        batch, spinning = int(best.split("-")[0][1:]), best.endswith("-spin")
        extra = {
            "sweep": rates,
            "engine_batch1_ms": round(1000 / max(rates["b1-spin"], rates["b1-nospin"]), 2),
        }
    sess = session(path, spinning)
    rate(sess, batch, size, 0)
    with Meter({"subject": [os.getpid()]}).window() as usage:
        done, _took = rate(sess, batch, size, seconds)
    extra |= {"batch": batch, "spinning": spinning}
    return CaseResult.from_usage("raw", args["model"], done, usage, extra=extra)


def run(ctx: Any, model: str, paired: bool = False) -> CaseResult:
    """The full sweep (once per model), or a short run at the sweep's best setting."""
    from bench.child import run_child

    info = ctx.models[model]
    args = {"model": model, "onnx": str(info.onnx), "size": info.input_size}
    best = ctx.raw.get(model)
    if paired and best is not None:
        args |= {
            "seconds": ctx.plan.paired_seconds,
            "batch": best.extra["batch"],
            "spinning": best.extra["spinning"],
        }
        paired_result = run_child("raw", args, ctx.log_dir)
        paired_result.case = "raw-paired"
        return paired_result
    args |= {
        "seconds": ctx.plan.raw_seconds,
        "sweep_seconds": ctx.plan.sweep_seconds,
        "sweep_batches": list(ctx.plan.sweep_batches),
    }
    result = run_child("raw", args, ctx.log_dir)
    ctx.raw[model] = result
    return result
