"""OpenTelemetry tracing, off unless an OTLP endpoint is configured.

`setup_tracing` is called by the process entry points (`kiln api`, `kiln worker`, `kiln run`).
Without `KILN_OTLP_ENDPOINT` (or the standard `OTEL_EXPORTER_OTLP_ENDPOINT`) it does nothing:
no SDK is imported, no `TracerProvider` is installed, and every span below is the API's no-op.

Span names: `<METHOD> <route>` (the API request: FastAPI's own telemetry, which turns on by
itself once a provider is installed, with `fastapi.endpoint` and friends), `kiln.job.submit`
and `kiln.bulk.submit`, `kiln.chunk.send` / `kiln.ingest.send` (producer: the context goes
into the Celery message headers), `kiln.process_chunk` / `kiln.ingest` (consumer: the task,
continuing the sender's trace), `kiln.batch` and `kiln.engine.infer`.

A batch holds rows of many tasks, so it cannot be the child of all of them: `kiln.batch` is
parented to the span that submitted its *first* row (so the first request's trace shows the
batch and engine time under it) and carries a span link to every other submitting span (so
the other requests' traces can find the batch they waited for).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from functools import wraps
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Link, NonRecordingSpan, Span, SpanContext, SpanKind

from kiln.app.core.config import Settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.util.types import AttributeValue

P = ParamSpec("P")
R = TypeVar("R")
Rows = TypeVar("Rows", bound=Sized)  # a batch: its len() is the span's row count
Result = TypeVar("Result")

TRACER = "kiln"
TRACES_PATH = "/v1/traces"


def endpoint(settings: Settings) -> str | None:
    """Where spans go: `KILN_OTLP_ENDPOINT`, else the standard OTel variables; None = off."""
    return (
        settings.otlp_endpoint
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )


def setup_tracing(settings: Settings, service: str, exporter: SpanExporter | None = None) -> bool:
    """Install an SDK `TracerProvider` exporting to OTLP/HTTP when an endpoint is configured
    (or to `exporter`, synchronously: what tests pass). Returns whether tracing is on."""
    if exporter is None and endpoint(settings) is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    processor: SpanProcessor
    if exporter is not None:
        processor = SimpleSpanProcessor(exporter)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = settings.otlp_endpoint
        if url and not url.rstrip("/").endswith(TRACES_PATH):
            url = url.rstrip("/") + TRACES_PATH  # a base URL, as OTEL_EXPORTER_OTLP_ENDPOINT is
        processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=url or None))
    name = os.environ.get("OTEL_SERVICE_NAME") or f"kiln-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    return True


def enabled() -> bool:
    """Whether a real (SDK) provider is installed rather than the API's no-op."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def tracer() -> trace.Tracer:
    """Kiln's tracer from whatever provider is installed (the no-op one when off)."""
    return trace.get_tracer(TRACER)


def traced(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated function in a span called `name` (looked up at call time)."""

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with tracer().start_as_current_span(name):
                return fn(*args, **kwargs)

        return run

    return decorate


def annotate(**attributes: AttributeValue | None) -> None:
    """Set attributes on the current span (skipping None); free when not recording."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({f"kiln.{k}": v for k, v in attributes.items() if v is not None})


# --- Celery: the context travels in the message headers ------------------------------------


@contextmanager
def producer_span(name: str, **attributes: AttributeValue) -> Iterator[dict[str, str]]:
    """A span around sending a message; yields the headers that carry it (empty when off)."""
    with tracer().start_as_current_span(name, kind=SpanKind.PRODUCER) as span:
        if span.is_recording():
            span.set_attributes(_kiln(attributes))
        headers: dict[str, str] = {}
        propagate.inject(headers)
        yield headers


class _RequestGetter(Getter[Any]):
    """Reads a header from a Celery `task.request`: custom message headers become attributes
    of the request (protocol 2), or sit in its `headers` dict (older senders)."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        value = getattr(carrier, key, None)
        if value is None:
            headers = getattr(carrier, "headers", None)
            value = headers.get(key) if isinstance(headers, Mapping) else None
        if value is None:
            return None
        return [value] if isinstance(value, str) else [str(v) for v in value]

    def keys(self, carrier: Any) -> list[str]:
        return []


@contextmanager
def consumer_span(name: str, request: Any, **attributes: AttributeValue) -> Iterator[Span]:
    """A task's span, continuing the trace whose context its message carries."""
    parent = propagate.extract(request, getter=_RequestGetter())
    with tracer().start_as_current_span(name, context=parent, kind=SpanKind.CONSUMER) as span:
        if span.is_recording():
            span.set_attributes(_kiln(attributes))
        yield span


# --- the Batcher: one span for rows of many tasks -------------------------------------------


def current_span_context() -> SpanContext:
    """The caller's span, remembered with each row it submits (invalid when off)."""
    return trace.get_current_span().get_span_context()


@contextmanager
def batch_span(origins: Sequence[SpanContext], **attributes: AttributeValue) -> Iterator[None]:
    """`kiln.batch`: parented to the first row's submitting span, linked to the others."""
    by_span: dict[tuple[int, int], SpanContext] = {}  # first row first; empty when off
    for context in origins:
        if context.is_valid:
            by_span.setdefault((context.trace_id, context.span_id), context)
    distinct = list(by_span.values())
    parent = trace.set_span_in_context(NonRecordingSpan(distinct[0])) if distinct else None
    links = [Link(c) for c in distinct[1:]]
    with tracer().start_as_current_span(
        "kiln.batch", context=parent, links=links, attributes=_kiln(attributes)
    ):
        yield


def _kiln(attributes: Mapping[str, AttributeValue]) -> dict[str, AttributeValue]:
    return {f"kiln.{k}": v for k, v in attributes.items()}


def traced_infer(
    fn: Callable[[Rows], Result], **attributes: AttributeValue
) -> Callable[[Rows], Result]:
    """Wrap a model's batch function in a `kiln.engine.infer` span (rows, model, backend)."""
    static = _kiln(attributes)

    def infer(rows: Rows) -> Result:
        with tracer().start_as_current_span("kiln.engine.infer") as span:
            if span.is_recording():
                span.set_attributes({**static, "kiln.rows": len(rows)})
            return fn(rows)

    return infer
