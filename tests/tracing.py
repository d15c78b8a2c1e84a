"""Tracing in tests: an SDK provider exporting to memory, and back to "off" afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from kiln.app.core.config import Settings
from kiln.app.observability.tracing import setup_tracing


def reset_tracing() -> None:
    """Forget the installed provider (the OTel API allows setting it once per process)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # what opentelemetry's own test utils do
    trace._TRACER_PROVIDER = None


@contextmanager
def in_memory_tracing(settings: Settings) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    reset_tracing()
    assert setup_tracing(settings, "test", exporter=exporter)
    try:
        yield exporter
    finally:
        reset_tracing()
