"""Kiln on real services: inputs in S3, one job submitted over HTTP, a real `kiln worker`.

The worker is warm (model loaded by a small job first), as a long-running service is.
"""

from __future__ import annotations

import os

from bench.context import Context
from bench.measure import SOLO, Meter, service_pids
from bench.results import CaseResult
from bench.stack import Stack


def meter(stack: Stack, subject: list[int] | None = None) -> Meter:
    """Subject (Kiln's API and worker, unless told), services, and the driver alone."""
    return Meter(
        {
            "subject": subject if subject is not None else stack.kiln_pids,
            "services": [stack.moto.pid, *service_pids()],
            "driver": [SOLO, os.getpid()],  # the client only: api, worker, moto are its children
        }
    )


def stats_for(stats: dict[str, dict[str, float]], model: str) -> dict[str, float]:
    """A model's totals, whether the worker labels it `name` (built-in) or `name:version`."""
    refs = [ref for ref in stats if ref == model or ref.rsplit(":", 1)[0] == model]
    return {k: sum(stats[ref].get(k, 0) for ref in refs) for k in ("batches", "rows")}


def mean_batch(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], model: str
) -> float | None:
    b, a = stats_for(before, model), stats_for(after, model)
    batches = a.get("batches", 0) - b.get("batches", 0)
    rows = a.get("rows", 0) - b.get("rows", 0)
    return round(rows / batches, 2) if batches else None


def run_job(ctx: Context, case: str, model: str, uris: list[str]) -> CaseResult:
    stack = ctx.require_stack()
    warm = stack.wait(stack.submit(model, uris[: min(len(uris), 64)]))
    if warm["counts"]["succeeded"] == 0:
        raise RuntimeError(f"warm-up job for {model} failed: {warm}")
    before = stack.batch_stats()
    with meter(stack).window() as usage:
        job = stack.wait(stack.submit(model, uris))
    counts = job["counts"]
    if job["status"] != "completed" or counts["succeeded"] != len(uris):
        raise RuntimeError(f"{case} {model}: job ended {job['status']} with {counts}")
    extra = {"mean_batch": mean_batch(before, stack.batch_stats(), model)}
    return CaseResult.from_usage(case, model, len(uris), usage, extra=extra)


def run(ctx: Context, model: str) -> CaseResult:
    return run_job(ctx, "services", model, ctx.uris["images"])


def run_ceiling(ctx: Context) -> CaseResult:
    """The null model on small images: what the orchestration itself can carry."""
    return run_job(ctx, "ceiling", "null", ctx.uris["small"])
