"""The content cache: its encoding (small outputs as JSON, a vector as exact raw bytes), its
scope (per tenant unless shared) and expiry, end to end through `process_chunk`."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import update

from devstack.images import solid
from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.app.db.models import ContentCache, utcnow
from kiln.app.db.session import unit_of_work
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.workers.chunk.content_cache import decode, encode, scope_key
from kiln.workers.chunk.run import process_chunk
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.runtime import WorkerRuntime
from tests.workers.colours import MODEL, register_colours


def test_outputs_without_a_vector_are_plain_json() -> None:
    outputs = {"labels": [{"label": "cat", "score": 0.9}]}
    small, vector, dtype = encode(outputs)
    assert (small, vector, dtype) == (outputs, None, None)
    assert decode(json.loads(json.dumps(small)), vector, dtype) == outputs


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_vector_round_trips_exactly(dtype: type) -> None:
    vector = np.random.default_rng(0).standard_normal(384).astype(dtype)
    small, raw, stored = encode({"embedding": vector, "tokens": 7})
    assert small == {"tokens": 7} and stored == np.dtype(dtype).name
    assert raw is not None and len(raw) == vector.nbytes
    restored = decode(small, raw, stored)
    assert restored["tokens"] == 7
    assert restored["embedding"].dtype == vector.dtype
    np.testing.assert_array_equal(restored["embedding"], vector)


# --- scope: per tenant unless shared (workers/chunk/content_cache.py scope_key) ------------


def colours(runtime: WorkerRuntime) -> ModelInfo:
    with runtime.sessions() as session:
        return runtime.model_info(session, MODEL, "acme")


def test_each_tenant_has_its_own_scope_unless_shared(runtime: WorkerRuntime) -> None:
    model, settings = colours(runtime), runtime.settings
    shared = settings.model_copy(update={"content_cache_shared": True})

    acme, globex = scope_key(settings, "acme", model), scope_key(settings, "globex", model)

    assert acme != globex and model.cache_key in acme
    assert scope_key(shared, "acme", model) == scope_key(shared, "globex", model) != acme
    assert scope_key(shared, "acme", model) != scope_key(settings, "shared", model)


# --- end to end: process_chunk on SQLite with the `colours` classifier ----------------------

RED = solid((250, 5, 5))


def run_red(runtime: WorkerRuntime, tenant: str, name: str = "r.png") -> ChunkReport:
    """One job of one red image for `tenant`, run; its chunk's report."""
    dispatcher = RecordingDispatcher()
    request = JobRequest(tenant=tenant, model=MODEL, uploads=[Upload(name, RED)])
    with runtime.sessions() as session:
        submit_job(session, runtime.store, dispatcher, runtime.settings, request)
    [call] = dispatcher.calls
    return process_chunk(runtime, call.job_id, call.chunk, call.item_ids)


def engine_rows(runtime: WorkerRuntime) -> int:
    return sum(s.rows for s in runtime.batch_stats().values())


def test_another_tenants_result_is_not_served(runtime: WorkerRuntime) -> None:
    run_red(runtime, "acme")

    first = run_red(runtime, "globex")
    again = run_red(runtime, "globex", "again.png")

    assert (first.cached, first.succeeded) == (0, 1)  # the engine ran for globex
    assert again.cached == 1  # globex's own result is
    assert engine_rows(runtime) == 2


def test_a_shared_cache_serves_every_tenant(settings: Settings, tmp_path: Path) -> None:
    runtime = WorkerRuntime(settings.model_copy(update={"content_cache_shared": True}))
    try:
        register_colours(runtime, tmp_path)
        run_red(runtime, "acme")

        report = run_red(runtime, "globex")

        assert (report.cached, report.succeeded) == (1, 1)
        assert engine_rows(runtime) == 1
    finally:
        runtime.close()


def test_an_expired_result_is_run_again_and_cached_anew(runtime: WorkerRuntime) -> None:
    run_red(runtime, "acme")
    with runtime.sessions() as session, unit_of_work(session):
        ttl = timedelta(seconds=runtime.settings.content_cache_ttl_s)
        session.execute(update(ContentCache).values(created_at=utcnow() - ttl - ttl / 10))

    expired = run_red(runtime, "acme", "later.png")
    fresh = run_red(runtime, "acme", "latest.png")

    assert (expired.cached, expired.succeeded) == (0, 1)
    assert fresh.cached == 1
    assert engine_rows(runtime) == 2
