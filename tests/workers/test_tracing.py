"""One job, one trace: the API request, the submit, each chunk's message and task, the
batches and the engine calls all share a trace id; a batch shared by rows of two tasks is
parented to the first and linked to the other."""

from __future__ import annotations

import threading
import warnings
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from starlette.exceptions import StarletteDeprecationWarning

from devstack.images import solid
from kiln.app.api.app import create_app
from kiln.app.core.config import Settings
from kiln.app.dispatch.producer import CeleryDispatcher
from kiln.app.observability.tracing import tracer
from kiln.app.tenants.auth import create_key
from kiln.workers.batching import Batcher, BatchPolicy, ListShape
from kiln.workers.celery.app import make_celery
from kiln.workers.runtime import WorkerRuntime
from tests.tracing import in_memory_tracing
from tests.workers.colours import MODEL

with warnings.catch_warnings():
    warnings.simplefilter("ignore", StarletteDeprecationWarning)
    from fastapi.testclient import TestClient


class SentMessages:
    """Stands in for the Celery app under a real `CeleryDispatcher`: keeps what it sends."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send_task(self, name: str, args: list[Any], **options: Any) -> None:
        self.sent.append({"name": name, "args": args, **options})


def _api_submit(settings: Settings, runtime: WorkerRuntime, broker: SentMessages) -> str:
    with runtime.sessions() as session:
        secret = create_key(session, "acme").secret
        session.commit()
    app = create_app(settings)
    with TestClient(app, headers={"Authorization": f"Bearer {secret}"}) as client:
        app.state.kiln.dispatcher = CeleryDispatcher(broker)  # type: ignore[arg-type]
        files = [("files", (f"{i}.png", solid((80 * i, 5, 5)), "image/png")) for i in range(5)]
        response = client.post("/v1/jobs", data={"model": MODEL}, files=files)
    assert response.status_code == 202, response.text
    job_id: str = response.json()["id"]
    return job_id


def _run_tasks(settings: Settings, runtime: WorkerRuntime, broker: SentMessages) -> None:
    """Run each sent message through the real task adapter, its headers on `task.request`
    as a Celery worker puts them."""
    celery = make_celery(settings)
    celery._runtime = runtime  # the fixture's runtime, with the `colours` model
    task = celery.tasks["kiln.process_chunk"]
    for message in broker.sent:
        task.push_request(delivery_info={"routing_key": message["queue"]}, **message["headers"])
        try:
            task.run(*message["args"])
        finally:
            task.pop_request()


def test_one_job_is_one_trace_from_the_api_to_the_engine(
    settings: Settings, runtime: WorkerRuntime
) -> None:
    broker = SentMessages()
    with in_memory_tracing(settings) as exporter:
        job_id = _api_submit(settings, runtime, broker)
        assert len(broker.sent) == 2  # 5 files in chunks of 3
        assert all("traceparent" in m["headers"] for m in broker.sent)
        _run_tasks(settings, runtime, broker)
        spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    for name in ("POST /v1/jobs", "kiln.job.submit", "kiln.chunk.send", "kiln.process_chunk"):
        assert name in names, names
    assert names.count("kiln.process_chunk") == 2
    assert "kiln.batch" in names and "kiln.engine.infer" in names
    assert len({s.context.trace_id for s in spans}) == 1  # one trace, API to engine
    by_id = {s.context.span_id: s for s in spans}
    assert _ancestry(by_id, _first(spans, "kiln.engine.infer")) == [
        "kiln.engine.infer",
        "kiln.batch",
        "kiln.process_chunk",
        "kiln.chunk.send",
        "kiln.job.submit",
        "fastapi.endpoint",  # FastAPI's own telemetry: on once a provider is installed
        "POST /v1/jobs",
    ]
    task = _first(spans, "kiln.process_chunk")
    assert task.attributes is not None and task.attributes["kiln.job_id"] == job_id


def test_a_batch_of_two_tasks_rows_links_the_second(settings: Settings) -> None:
    with in_memory_tracing(settings) as exporter:
        gate = threading.Barrier(2)
        batcher: Batcher[list[int], list[Any]] = Batcher(
            lambda parts: [row for p in parts for row in p.block[p.start : p.stop]],
            ListShape(),
            BatchPolicy(max_batch=2, max_delay_s=5.0),
            name="t",
        )

        def caller(name: str) -> None:
            with tracer().start_as_current_span(name):
                gate.wait()
                batcher.submit([1]).result(timeout=10)

        threads = [threading.Thread(target=caller, args=(f"task-{i}",)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        batcher.close()
        spans = exporter.get_finished_spans()
    (batch,) = [s for s in spans if s.name == "kiln.batch"]
    tasks = {s.context.span_id: s for s in spans if s.name.startswith("task-")}
    assert batch.parent is not None and batch.parent.span_id in tasks
    (link,) = batch.links
    assert link.context.span_id in tasks and link.context.span_id != batch.parent.span_id
    assert batch.attributes is not None and batch.attributes["kiln.batch_size"] == 2


def _first(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    return next(s for s in spans if s.name == name)


def _ancestry(by_id: dict[int, ReadableSpan], span: ReadableSpan) -> list[str]:
    names = [span.name]
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names
