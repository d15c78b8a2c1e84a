"""Kiln on real services: inputs in S3, one job submitted over HTTP, a real `kiln worker`.

The worker is warm (model loaded by a small job first), as a long-running service is.
`ceiling-local` is the null-model ceiling as a user without S3 meets it: Kiln on local storage,
the inputs uploaded over HTTP as multipart jobs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bench.context import Context
from bench.measure import SOLO, Meter, Usage, service_pids
from bench.results import CaseResult
from bench.stack import Layout, Stack, local_deployment

UPLOAD_JOB = 1000  # inputs per multipart job in `ceiling-local`
WARM_UP = 64


def meter(stack: Stack, subject: list[int] | None = None) -> Meter:
    """Subject (Kiln's API and workers, unless told), services (Postgres and Redis), moto's S3
    server apart (where Kiln's store is in it), and the driver alone."""
    groups: dict[str, Sequence[int]] = {
        "subject": subject if subject is not None else stack.kiln_pids,
        "services": service_pids(),
    }
    if stack.storage == "s3":
        groups["moto"] = [stack.moto.pid]
    groups["driver"] = [SOLO, os.getpid()]  # the client only: api, worker, moto are its children
    return Meter(groups)


def cpu_per_item(usage: Usage, items: int) -> dict[str, float]:
    """CPU ms per item of each group but the driver: `subject_cpu_ms_per_item`, …"""
    return {
        f"{group}_cpu_ms_per_item": round(1000 * seconds / items, 3)
        for group, seconds in usage.cpu_seconds.items()
        if group != "driver" and items
    }


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
    extra = {
        "mean_batch": mean_batch(before, stack.batch_stats(), model),
        **cpu_per_item(usage, len(uris)),
    }
    return CaseResult.from_usage(case, model, len(uris), usage, extra=extra)


def run(ctx: Context, model: str) -> CaseResult:
    return run_job(ctx, "services", model, ctx.uris["images"])


def run_ceiling(ctx: Context) -> CaseResult:
    """The null model on small images in moto S3: what the orchestration itself can carry."""
    return run_job(ctx, "ceiling", "null", ctx.uris["small"][: ctx.plan.ceiling_items])


def run_ceiling_local(ctx: Context) -> CaseResult:
    """The null model on small images uploaded over HTTP (multipart jobs of UPLOAD_JOB) into a
    Kiln on local storage, one worker: the ceiling without S3 anywhere."""
    parent = ctx.require_stack()
    files = [(p.name, p.read_bytes()) for p in ctx.small_images[: ctx.plan.ceiling_local_items]]
    layout = Layout(name="local", storage="local")
    with local_deployment(parent, ctx.log_dir, dict(ctx.plan.kiln_env), layout) as stack:
        stack.register(ctx.models["null"], ctx.workdir)
        warm = files[:WARM_UP]
        _check(stack.wait(upload_job(stack, "null", warm)), len(warm))
        before = stack.batch_stats()
        with meter(stack).window() as usage:
            ids = [
                upload_job(stack, "null", files[i : i + UPLOAD_JOB])
                for i in range(0, len(files), UPLOAD_JOB)
            ]
            jobs = [stack.wait(job_id) for job_id in ids]
        for job, start in zip(jobs, range(0, len(files), UPLOAD_JOB), strict=True):
            _check(job, len(files[start : start + UPLOAD_JOB]))
        extra: dict[str, Any] = {
            "mean_batch": mean_batch(before, stack.batch_stats(), "null"),
            "jobs": len(ids),
            **_started_to_finished(jobs, len(files)),
            **cpu_per_item(usage, len(files)),
        }
    return CaseResult.from_usage("ceiling-local", "null", len(files), usage, extra=extra)


def upload_job(stack: Stack, model: str, files: Sequence[tuple[str, bytes]]) -> str:
    """One multipart job of `files` (name, bytes), as `kiln submit` of a folder sends it."""
    response = stack.http.post(
        "/v1/jobs",
        data={"model": model},
        files=[("files", (name, data, "image/jpeg")) for name, data in files],
    )
    if response.status_code != 202:
        raise RuntimeError(f"upload failed: {response.status_code} {response.text[:500]}")
    return str(response.json()["id"])


def _check(job: dict[str, Any], expected: int) -> None:
    if job["status"] != "completed" or job["counts"]["succeeded"] != expected:
        raise RuntimeError(f"ceiling-local: job ended {job['status']} with {job['counts']}")


def _started_to_finished(jobs: Sequence[dict[str, Any]], items: int) -> dict[str, float]:
    """The issue's measure: items ÷ (first job's started_at → last job's finished_at)."""
    started = min(datetime.fromisoformat(j["started_at"]) for j in jobs)
    finished = max(datetime.fromisoformat(j["finished_at"]) for j in jobs)
    seconds = (finished - started).total_seconds()
    return {
        "started_to_finished_s": round(seconds, 3),
        "items_per_s_started_to_finished": round(items / seconds, 1) if seconds > 0 else 0.0,
    }
