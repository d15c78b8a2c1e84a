"""Prometheus metrics of the API process, served at `GET /metrics`.

One registry per app (built by `create_app`, nothing registered globally or at import).
HTTP requests are counted by a small ASGI middleware; jobs, items and queue depths are read
at scrape time: one GROUP BY per table in Postgres and one pipelined LLEN round trip to Redis.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.app.db.models import OPEN_JOB_STATUSES, Item, Job, JobStatus
from kiln.app.dispatch.depths import read_queue_lengths

if TYPE_CHECKING:
    from kiln.app.api.context import ApiContext

log = logging.getLogger(__name__)

ContextFn = Callable[[], "ApiContext | None"]  # None before the lifespan has built it
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class JobsCollector(Collector):
    """`kiln_jobs{status}` for every status (zeros included), and the items of open jobs
    by model and status: the backlog, bounded by what is still running."""

    def __init__(self, context: ContextFn) -> None:
        self.context = context

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("kiln_jobs", "Jobs by status.", labels=["status"])
        items = GaugeMetricFamily(
            "kiln_open_job_items",
            "Items of jobs not yet finished (queued, running, cancelling), by model and status.",
            labels=["model", "status"],
        )
        counts = self._read()
        if counts is not None:
            by_status, by_model = counts
            for job_status in JobStatus:
                jobs.add_metric([str(job_status)], by_status.get(str(job_status), 0))
            for (model, item_status), count in sorted(by_model.items()):
                items.add_metric([model, item_status], count)
        yield jobs
        yield items

    def _read(self) -> tuple[dict[str, int], dict[tuple[str, str], int]] | None:
        context = self.context()
        if context is None:
            return None
        open_items = (
            select(Job.model, Item.status, func.count())
            .join(Job, Item.job_id == Job.id)
            .where(Job.status.in_([str(s) for s in OPEN_JOB_STATUSES]))
            .group_by(Job.model, Item.status)
        )
        try:
            with context.sessions() as session:
                by_status = session.execute(
                    select(Job.status, func.count()).group_by(Job.status)
                ).all()
                by_model = session.execute(open_items).all()
        except Exception as error:  # a scrape must answer even with the database away
            log.warning("metrics: could not count jobs: %s", error)
            return None
        return {s: n for s, n in by_status}, {(m, s): n for m, s, n in by_model}


class QueueCollector(Collector):
    """`kiln_queue_length{queue}`: messages waiting in each Celery queue (every priority
    list kombu keeps for it). Only a Redis broker can be read; otherwise no samples."""

    def __init__(self, context: ContextFn, queues: tuple[str, ...]) -> None:
        self.context = context
        self.queues = queues

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kiln_queue_length", "Messages waiting in a broker queue.", labels=["queue"]
        )
        for queue, length in self._read().items():
            family.add_metric([queue], length)
        yield family

    def _read(self) -> dict[str, int]:
        context = self.context()
        if context is None:
            return {}
        lengths = read_queue_lengths(context.celery, context.settings.broker_url, self.queues)
        return lengths or {}


class ApiMetrics:
    """The API's registry: HTTP series updated per request, the rest read at scrape time."""

    def __init__(self, context: ContextFn, queues: tuple[str, ...]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kiln_http_requests",
            "HTTP requests by route template, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kiln_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template and method.",
            ["route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(JobsCollector(context))
        self.registry.register(QueueCollector(context, queues))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in METHODS else "OTHER"
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)


class HttpMetricsMiddleware:
    """Counts and times every HTTP request, labelled by the matched route's template (never
    the raw path, so ids do not explode the series); unmatched paths share one label."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless the app starts a response

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe(route, scope["method"], status, time.perf_counter() - started)


def install_metrics(app: FastAPI) -> ApiMetrics:
    """A registry for this app, the request middleware, and `GET /metrics`."""
    from kiln.app.api.routes import metrics as route
    from kiln.app.dispatch.contract import QUEUES

    metrics = ApiMetrics(lambda: getattr(app.state, "kiln", None), QUEUES)
    app.state.metrics = metrics
    app.add_middleware(HttpMetricsMiddleware, metrics=metrics)
    app.include_router(route.router)
    return metrics
