"""Tracing set-up: off by default (no SDK provider), on with an OTLP endpoint; the Celery
header carrier; the API middleware."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kiln.app.core.config import Settings, get_settings
from kiln.app.observability import tracing
from tests.tracing import in_memory_tracing, reset_tracing


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    for name in ("KILN_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    reset_tracing()
    yield get_settings(data_dir=tmp_path)
    reset_tracing()


def test_off_by_default_installs_no_sdk_provider(settings: Settings) -> None:
    assert tracing.endpoint(settings) is None
    assert tracing.setup_tracing(settings, "api") is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    assert not tracing.enabled()
    with tracing.tracer().start_as_current_span("x") as span:
        assert not span.is_recording()
    with tracing.producer_span("kiln.chunk.send", job_id="j") as headers:
        assert headers == {}  # nothing to carry: the message is as before


def test_an_endpoint_installs_the_sdk_provider(settings: Settings) -> None:
    on = settings.model_copy(update={"otlp_endpoint": "http://127.0.0.1:4318"})
    assert tracing.setup_tracing(on, "worker") is True
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    assert provider.resource.attributes["service.name"] == "kiln-worker"
    assert tracing.enabled()


def test_the_standard_variable_turns_it_on(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.endpoint(settings) == "http://127.0.0.1:4318"


def test_a_task_continues_the_trace_its_headers_carry(settings: Settings) -> None:
    with in_memory_tracing(settings) as exporter:
        with tracing.producer_span("kiln.chunk.send", job_id="j", chunk=0) as headers:
            assert "traceparent" in headers
        # Celery (protocol 2) turns custom headers into attributes of `task.request`.
        for request in (SimpleNamespace(**headers), SimpleNamespace(headers=headers)):
            with tracing.consumer_span("kiln.process_chunk", request, job_id="j"):
                pass
        sent, *tasks = exporter.get_finished_spans()
    assert [t.parent.span_id for t in tasks if t.parent] == [sent.context.span_id] * 2
    assert {t.context.trace_id for t in tasks} == {sent.context.trace_id}
    assert sent.attributes is not None and sent.attributes["kiln.job_id"] == "j"


def test_a_message_without_context_starts_a_new_trace(settings: Settings) -> None:
    with in_memory_tracing(settings) as exporter:
        with tracing.consumer_span("kiln.ingest", SimpleNamespace(headers=None)):
            pass
        (span,) = exporter.get_finished_spans()
    assert span.parent is None
