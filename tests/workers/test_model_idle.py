"""A real worker runtime lets go of a model no chunk has used for `KILN_MODEL_IDLE_S` — its
Batcher and its shared-memory slots — and never of one in use; and it says what it holds:
its own resident memory and its prep processes', per model its engines' and its slots' bytes,
in its metrics and in the facts the fleet page shows. phash is the model (no engine to build:
it loads in a moment, and its slots are real)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from kiln.app.catalog.catalog import builtin_model
from kiln.workers.ops.facts import worker_facts
from kiln.workers.ops.metrics import worker_registry
from kiln.workers.runtime import WorkerRuntime
from tests.support import migrated_settings
from tests.workers.test_metrics import samples

IDLE_S = 0.4


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WorkerRuntime]:
    settings = migrated_settings(
        tmp_path, monkeypatch, model_idle_s=IDLE_S, prep_processes=1, max_batch=8
    )
    runtime = WorkerRuntime(settings)
    try:
        yield runtime
    finally:
        runtime.close()


def eventually(check: Callable[[], bool], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_an_idle_model_is_unloaded_and_its_slots_go(
    runtime: WorkerRuntime, caplog: pytest.LogCaptureFixture
) -> None:
    phash = builtin_model("phash")
    # Capture from before the load: the idle clock starts there, and on a loaded machine the
    # thread may unload it before this test looks again.
    with caplog.at_level(logging.INFO, logger="kiln.workers.runners.runners"):
        runner = runtime.models.runner(phash)
        slots = runner.slots
        assert slots is not None
        assert eventually(lambda: not runtime.models.runners())  # the thread let it go
        assert eventually(lambda: not slots.segment.path.exists())  # the shared memory too
        # The line is written after the slots go: wait for it inside the capture.
        said = "model phash unloaded after 0.4 s unused"
        assert eventually(lambda: said in caplog.text), caplog.text
    assert runtime.engine_health().idle_unloaded == 1


def test_a_model_in_use_is_kept_past_the_idle_time(runtime: WorkerRuntime) -> None:
    phash = builtin_model("phash")
    with runtime.models.using(phash) as held:
        time.sleep(3 * IDLE_S)  # the thread looked several times meanwhile
        assert runtime.models.unload_idle() == []
        assert runtime.models.runners() == {phash.cache_key: held}
        slots = held.slots
        assert slots is not None and slots.segment.path.exists()
    assert eventually(lambda: not runtime.models.runners())  # idle from the moment it was let go
    with runtime.models.using(phash) as again:  # the next chunk loads it again
        assert again is not held


def test_the_worker_says_what_it_holds(runtime: WorkerRuntime) -> None:
    phash = builtin_model("phash")
    with runtime.models.using(phash) as runner:
        health = runtime.engine_health()
        facts = worker_facts(runtime, None)
        metrics = samples(generate_latest(worker_registry(runtime)).decode())
    assert health.prep_processes == 1
    assert health.rss_bytes is not None and health.rss_bytes > 50 * 2**20
    assert health.prep_rss_bytes is not None and health.prep_rss_bytes > 2**20
    assert runner.slot_bytes > 0 and health.slot_memory == {"phash": runner.slot_bytes}
    assert health.memory == {"phash": 0}  # no engine: what it holds is its slots
    assert facts["memory"]["rss_bytes"] > 50 * 2**20
    assert facts["memory"]["prep_rss_bytes"] > 2**20
    model = facts["models"]["phash"]
    assert (model["memory_bytes"], model["slot_bytes"]) == (0, runner.slot_bytes)
    assert metrics[("kiln_worker_rss_bytes", ())] > 50 * 2**20
    assert metrics[("kiln_prep_rss_bytes", ())] > 2**20
    assert metrics[("kiln_model_slot_bytes", (("model", "phash"),))] == runner.slot_bytes
