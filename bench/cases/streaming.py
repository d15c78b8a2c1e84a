"""Streaming: many clients each submitting one-image jobs, and an idle client.

Capacity is measured first, closed loop: `CLOSED_LOOP_CLIENTS` clients submit back to back and
the rate of completed one-image jobs is what the stack can carry. Then open loop at 50% and
100% of it: a job every 1/rate seconds whether or not earlier ones have finished, as
independent users would. Each client uploads one image and waits (long-poll) for its job to
close; latency is submit → result seen by the client.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from bench.cases.services import mean_batch, meter
from bench.context import Context
from bench.measure import percentiles
from bench.results import CaseResult
from bench.stack import CLOSED, Stack

FRACTIONS = (0.5, 1.0)
LONG_POLL_S = 10.0
CLOSED_LOOP_CLIENTS = 32


class Client:
    """One thread's HTTP client: upload one image, wait (long-poll) until its job closes."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._local = threading.local()

    def _http(self) -> httpx.Client:
        if not hasattr(self._local, "http"):
            self._local.http = httpx.Client(
                base_url=self.stack.api_url, headers=self.stack.http.headers, timeout=60
            )
        return self._local.http  # type: ignore[no-any-return]

    def one(self, model: str, name: str, data: bytes) -> float:
        """Submit→result seconds for one single-image job."""
        http = self._http()
        started = time.perf_counter()
        response = http.post(
            "/v1/jobs", data={"model": model}, files=[("files", (name, data, "image/jpeg"))]
        )
        if response.status_code != 202:
            raise RuntimeError(f"submit failed: {response.status_code} {response.text}")
        job_id = response.json()["id"]
        while True:
            job = http.get(f"/v1/jobs/{job_id}", params={"wait": LONG_POLL_S}).json()
            if job["status"] in CLOSED:
                if job["counts"]["succeeded"] != 1:
                    raise RuntimeError(f"streamed job {job_id} ended {job}")
                return time.perf_counter() - started
            time.sleep(0.02)  # an API without long-poll answers at once


def _open_loop(
    client: Client, model: str, images: list[tuple[str, bytes]], rate: float, seconds: float
) -> list[float]:
    count = max(1, int(rate * seconds))
    futures: list[Future[float]] = []
    with ThreadPoolExecutor(max_workers=256, thread_name_prefix="bench-client") as pool:
        start = time.perf_counter()
        for k in range(count):
            delay = start + k / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            name, data = images[k % len(images)]
            futures.append(pool.submit(client.one, model, name, data))
        return [f.result() for f in futures]


def _closed_loop(
    client: Client, model: str, images: list[tuple[str, bytes]], seconds: float
) -> list[float]:
    deadline = time.perf_counter() + seconds

    def loop(offset: int) -> list[float]:
        done: list[float] = []
        while time.perf_counter() < deadline:
            done.append(client.one(model, *images[(offset + len(done)) % len(images)]))
        return done

    with ThreadPoolExecutor(CLOSED_LOOP_CLIENTS, thread_name_prefix="bench-client") as pool:
        return [s for part in pool.map(loop, range(CLOSED_LOOP_CLIENTS)) for s in part]


def capacity(
    ctx: Context, client: Client, model: str, images: list[tuple[str, bytes]]
) -> CaseResult:
    stack = ctx.require_stack()
    before = stack.batch_stats()
    with meter(stack).window() as usage:
        latencies = _closed_loop(client, model, images, ctx.plan.stream_seconds)
    return CaseResult.from_usage(
        "streaming-capacity",
        model,
        len(latencies),
        usage,
        latency_ms=percentiles([1000 * s for s in latencies]),
        extra={
            "clients": CLOSED_LOOP_CLIENTS,
            "mean_batch": mean_batch(before, stack.batch_stats(), model),
            "max_batch": stack.settings.batch_cap(on_gpu=False),
        },
    )


def run(ctx: Context, model: str) -> list[CaseResult]:
    """Capacity for one-image jobs, then 50% and 100% of it, then idle single-image jobs."""
    stack = ctx.require_stack()
    client = Client(stack)
    images = [(p.name, p.read_bytes()) for p in ctx.images[:64]]
    client.one(model, *images[0])  # warm
    saturated = capacity(ctx, client, model, images)
    out = [saturated]
    for fraction in FRACTIONS:
        rate = max(0.5, fraction * saturated.items_per_s)
        before = stack.batch_stats()
        with meter(stack).window() as usage:
            latencies = _open_loop(client, model, images, rate, ctx.plan.stream_seconds)
        extra: dict[str, Any] = {
            "offered_per_s": round(rate, 2),
            "fraction_of_capacity": fraction,
            "mean_batch": mean_batch(before, stack.batch_stats(), model),
            "max_batch": stack.settings.batch_cap(on_gpu=False),
        }
        out.append(
            CaseResult.from_usage(
                f"streaming-{int(fraction * 100)}",
                model,
                len(latencies),
                usage,
                latency_ms=percentiles([1000 * s for s in latencies]),
                extra=extra,
            )
        )
    out.append(idle(ctx, client, model, images))
    return out


def idle(ctx: Context, client: Client, model: str, images: list[tuple[str, bytes]]) -> CaseResult:
    """One job at a time on an idle system: the latency floor of an interactive request."""
    latencies = []
    for k in range(ctx.plan.idle_samples):
        time.sleep(0.2)
        latencies.append(1000 * client.one(model, *images[k % len(images)]))
    batch1 = ctx.raw[model].extra.get("engine_batch1_ms") if model in ctx.raw else None
    return CaseResult(
        "idle",
        model,
        items=len(latencies),
        seconds=round(sum(latencies) / 1000, 3),
        latency_ms=percentiles(latencies),
        extra={"engine_batch1_ms": batch1},
    )
