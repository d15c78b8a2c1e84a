"""Fallback models in `process_chunk`: the inputs a job's model failed or refused are run again
through its fallback in the same run, every row says which model answered it and why not the
job's own, and the job's counts say how many fell back (SQLite, a local store, real ONNX)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from sqlalchemy import select

from devstack.images import solid
from kiln.app.catalog.catalog import ModelInfo, builtin_model, register_model
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.db import counters, queries
from kiln.app.db.models import ContentCache, Item, ItemStatus
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.jobs import JobRequest, Upload, submit_job
from kiln.app.results import results
from kiln.workers.chunk.run import process_chunk
from kiln.workers.chunk.stats import ChunkReport
from kiln.workers.close.close import ClosingJob, close_job
from kiln.workers.close.fallback import Fallback, job_fallback, shard_fields
from kiln.workers.runtime import WorkerRuntime
from tests.models import colour_classifier
from tests.workers.colours import MODEL

STRICT = "strict"  # the `colours` net, refusing answers under 0.5
RED, GREEN, GREY = solid((250, 5, 5)), solid((5, 250, 5)), solid((128, 128, 128))
REFUSED = "Refused: the top score 0.3333 is below the model's floor 0.5."
NOT_AN_IMAGE = "The file is neither an image nor a video Kiln can read."
# chunk 0: red, grey, green; chunk 1: grey again (other bytes), not an image
FILES = [
    ("r.png", RED),
    ("grey.png", GREY),
    ("g.png", GREEN),
    ("grey2.png", solid((120, 120, 120), size=(40, 20))),
    ("notes.txt", b"these are not pixels"),
]


@pytest.fixture(autouse=True)
def _strict(runtime: WorkerRuntime, tmp_path: Path) -> None:
    colour_classifier(tmp_path / "strict.onnx")
    spec = ImageModelSpec(
        input_size=32, labels=["red", "green", "blue", "dark"], mean=(0, 0, 0), std=(1, 1, 1),
        top_k=2, refuse_below=0.5,
    )  # fmt: skip
    with runtime.sessions() as session:
        register_model(
            session, runtime.store, tenant="", name=STRICT,
            data=(tmp_path / "strict.onnx").read_bytes(), kind="classify", spec=spec,
        )  # fmt: skip


def run_job(
    runtime: WorkerRuntime,
    fallback: dict[str, Any] | None,
    files: list[tuple[str, bytes]] = FILES,
    model: str = STRICT,
) -> tuple[str, list[ChunkReport]]:
    dispatcher = RecordingDispatcher()
    request = JobRequest(
        tenant="acme",
        model=model,
        uploads=[Upload(name, data) for name, data in files],
        options={"fallback": fallback} if fallback else None,
    )
    with runtime.sessions() as session:
        job_id = submit_job(session, runtime.store, dispatcher, runtime.settings, request).job.id
    reports = [process_chunk(runtime, c.job_id, c.chunk, c.item_ids) for c in dispatcher.calls]
    return job_id, reports


def items(runtime: WorkerRuntime, job_id: str) -> dict[str, Item]:
    with runtime.sessions() as session:
        rows = session.scalars(select(Item).where(Item.job_id == job_id).order_by(Item.id))
        return {item.key: item for item in rows}


def place(runtime: WorkerRuntime, job_id: str) -> results.Place:
    return results.Place(runtime.store, results.results_prefix(job_id))


def shard_rows(runtime: WorkerRuntime, job_id: str) -> dict[str, dict[str, Any]]:
    table = results.combined_table(place(runtime, job_id))
    return {row["key"]: row for row in table.to_pylist()}


def manifest(runtime: WorkerRuntime, job_id: str) -> dict[str, Any]:
    return dict(json.loads(runtime.store.get(results.manifest_key(place(runtime, job_id)))))


def counts(runtime: WorkerRuntime, job_id: str) -> queries.Counts:
    with runtime.sessions() as session:
        assert counters.difference(session, job_id) == counters.Tally()  # kept = recounted
        return queries.job_counts(session, job_id)


def test_refused_inputs_are_answered_by_the_fallback(runtime: WorkerRuntime) -> None:
    job_id, reports = run_job(runtime, {"model": MODEL, "on": ["refused"]}, FILES[:4])
    assert [(r.processed, r.succeeded, r.failed, r.fell_back) for r in reports] == [
        (3, 3, 0, 1),
        (1, 1, 0, 1),
    ]
    rows = items(runtime, job_id)
    assert {k: (i.status, i.answered_by, i.fallback_reason) for k, i in rows.items()} == {
        "r.png": (ItemStatus.SUCCEEDED, "strict:1", None),
        "grey.png": (ItemStatus.SUCCEEDED, "colours:1", REFUSED),
        "g.png": (ItemStatus.SUCCEEDED, "strict:1", None),
        "grey2.png": (ItemStatus.SUCCEEDED, "colours:1", REFUSED),  # equal channels: a third
    }
    assert rows["grey.png"].error is None and rows["grey.png"].outputs is not None
    assert rows["grey.png"].outputs["labels"][0]["score"] == pytest.approx(1 / 3, abs=1e-3)
    shard = shard_rows(runtime, job_id)
    assert shard["grey.png"]["answered_by"] == "colours:1"
    assert shard["grey.png"]["fallback_reason"] == REFUSED
    assert shard["r.png"]["answered_by"] == "strict:1" and shard["r.png"]["fallback_reason"] is None
    found = counts(runtime, job_id)
    assert (found.succeeded, found.failed) == (4, 0)
    assert (found.fell_back, found.fell_back_succeeded) == (2, 2)
    written = manifest(runtime, job_id)
    assert (written["counts"]["fell_back"], written["counts"]["fell_back_succeeded"]) == (2, 2)
    assert written["fallback"] == {"model": "colours:1", "on": ["refused"]}


def test_without_a_fallback_a_refusal_fails_the_item(runtime: WorkerRuntime) -> None:
    job_id, _ = run_job(runtime, None, FILES[:3])
    grey = items(runtime, job_id)["grey.png"]
    assert (grey.status, grey.error, grey.outputs) == (ItemStatus.FAILED, REFUSED, None)
    assert (grey.answered_by, grey.fallback_reason) == (None, None)
    found = counts(runtime, job_id)
    assert (found.failed, found.fell_back) == (1, 0)
    assert "fallback" not in manifest(runtime, job_id)


def test_a_fallback_takes_only_the_failures_it_names(runtime: WorkerRuntime) -> None:
    """`on` defaults to "failed": a refusal stays failed; an input the job's model could not
    decode goes to the fallback, which cannot read it either: it fails with both reasons."""
    job_id, reports = run_job(runtime, {"model": "phash"})
    rows = items(runtime, job_id)
    assert (rows["grey.png"].status, rows["grey.png"].error) == (ItemStatus.FAILED, REFUSED)
    assert rows["grey.png"].fallback_reason is None
    notes = rows["notes.txt"]
    assert notes.status == ItemStatus.FAILED and notes.fallback_reason == NOT_AN_IMAGE
    assert notes.error == f"{NOT_AN_IMAGE} The fallback model 'phash' failed too: {NOT_AN_IMAGE}"
    assert notes.answered_by is None
    assert sum(r.fell_back for r in reports) == 1
    found = counts(runtime, job_id)
    assert (found.failed, found.fell_back, found.fell_back_succeeded) == (3, 1, 0)


def test_a_shard_holds_both_models_columns(runtime: WorkerRuntime) -> None:
    job_id, _ = run_job(runtime, {"model": "phash", "on": ["failed", "refused"]}, FILES[:3])
    table = pq.read_table(
        io.BytesIO(runtime.store.get(results.shard_key(place(runtime, job_id), 0)))
    )
    assert table.column_names[-2:] == ["labels", "phash"]
    rows = {row["key"]: row for row in table.to_pylist()}
    assert rows["grey.png"]["answered_by"] == "phash" and len(rows["grey.png"]["phash"]) == 16
    assert rows["grey.png"]["labels"] is None and rows["grey.png"]["fallback_reason"] == REFUSED
    assert rows["r.png"]["labels"][0]["label"] == "red" and rows["r.png"]["phash"] is None


def test_a_shard_rewritten_from_the_database_keeps_who_answered(runtime: WorkerRuntime) -> None:
    job_id, _ = run_job(runtime, {"model": "phash", "on": ["refused"]}, FILES[:3])
    written = shard_rows(runtime, job_id)
    where = place(runtime, job_id)
    runtime.store.delete(results.shard_key(where, 0))  # as if the run stopped before its shard
    with runtime.sessions() as session:
        fallback = job_fallback(runtime, session, "acme", {"fallback": {"model": "phash"}})
        strict = runtime.model_info(session, STRICT, "acme")
        fields = shard_fields(strict, fallback)  # a replay of the closed job heals it
        close_job(session, runtime.store, ClosingJob(job_id, False, strict, where, fields, None))
    rewritten = shard_rows(runtime, job_id)
    assert rewritten["grey.png"]["answered_by"] == "phash"
    assert rewritten["grey.png"]["fallback_reason"] == REFUSED
    assert rewritten["grey.png"]["phash"] == written["grey.png"]["phash"]
    assert rewritten["r.png"]["answered_by"] == "strict:1" and rewritten["r.png"]["labels"]


def test_a_fallback_that_cannot_load_leaves_both_reasons(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.workers.runners import runners as runners_module

    real = runners_module.load_predictor

    def load(info: ModelInfo, engines: Any) -> Any:
        if info.name == MODEL:
            raise RuntimeError("no backend can build it")
        return real(info, engines)

    monkeypatch.setattr(runners_module, "load_predictor", load)
    job_id, _ = run_job(runtime, {"model": MODEL, "on": ["refused"]}, FILES[:3])
    rows = items(runtime, job_id)
    grey = rows["grey.png"]
    assert grey.status == ItemStatus.FAILED and grey.fallback_reason == REFUSED
    assert grey.error == (
        f"{REFUSED} The fallback model 'colours:1' failed too: Model 'colours:1' could not be "
        "loaded: no backend can build it."
    )
    assert rows["r.png"].status == ItemStatus.SUCCEEDED  # the job's model's answers stand
    found = counts(runtime, job_id)
    assert (found.succeeded, found.failed, found.fell_back, found.fell_back_succeeded) == (
        2, 1, 1, 0,
    )  # fmt: skip


def test_the_cache_keeps_each_models_answers_apart(runtime: WorkerRuntime) -> None:
    """The fallback's answer is cached under the fallback's scope: the job's model alone
    still refuses the same bytes, and the fallback model alone is answered from its cache."""
    run_job(runtime, {"model": MODEL, "on": ["refused"]}, [("grey.png", GREY)])
    with runtime.sessions() as session:
        scopes = set(session.scalars(select(ContentCache.model_key)))
        strict = runtime.model_info(session, STRICT, "acme")
        colours = runtime.model_info(session, MODEL, "acme")
    assert scopes == {f"t:acme/{colours.cache_key}"}  # the refusal itself is never cached
    job_id, _ = run_job(runtime, None, [("again.png", GREY)])
    assert items(runtime, job_id)["again.png"].error == REFUSED
    job_id, [report] = run_job(runtime, None, [("plain.png", GREY)], model=MODEL)
    assert report.cached == 1 and items(runtime, job_id)["plain.png"].answered_by == "colours:1"
    assert strict.cache_key != colours.cache_key


def test_a_fallback_takes_the_failures_its_job_names(runtime: WorkerRuntime) -> None:
    fallback = Fallback(builtin_model("phash"), frozenset({"refused"}))
    assert fallback.takes("refused") and not fallback.takes("failed")
    assert not fallback.takes(None)  # an input that could not be read: no model can
    with runtime.sessions() as session:
        assert job_fallback(runtime, session, "acme", {"max_distance": 3}) is None
        found = job_fallback(runtime, session, "acme", {"fallback": {"model": "colours:1"}})
    assert found is not None and (found.model.ref, found.on) == ("colours:1", {"failed"})


def test_a_videos_refused_frames_are_answered_by_the_fallback(
    runtime: WorkerRuntime, tmp_path: Path
) -> None:
    """Frames are items: the frames the strict model refuses (grey seconds of the clip) go to
    the fallback, the others are its own."""
    from PIL import Image

    from tests import videos

    colours = [(250, 5, 5), (128, 128, 128), (5, 250, 5), (128, 128, 128)]  # one per second
    frames = (Image.new("RGB", (64, 48), colours[i // 10]) for i in range(40))
    clip = videos.encode(tmp_path / "clip.mkv", frames, 10, (64, 48))
    dispatcher = RecordingDispatcher()
    request = JobRequest(
        tenant="acme", model=STRICT, uploads=[Upload("clip.mkv", clip.read_bytes())],
        options={"fallback": {"model": MODEL, "on": ["refused"]}, "video_fps": 1},
    )  # fmt: skip
    with runtime.sessions() as session:
        job_id = submit_job(session, runtime.store, dispatcher, runtime.settings, request).job.id
    pending = list(dispatcher.calls)
    while pending:
        call = pending.pop(0)
        sent = RecordingDispatcher()
        process_chunk(runtime, call.job_id, call.chunk, call.item_ids, dispatcher=sent)
        pending += sent.calls
    rows = items(runtime, job_id)
    assert {k: (i.status, i.answered_by, i.fallback_reason) for k, i in rows.items()} == {
        "clip.mkv#t=0.000": (ItemStatus.SUCCEEDED, "strict:1", None),
        "clip.mkv#t=1.000": (ItemStatus.SUCCEEDED, "colours:1", REFUSED),
        "clip.mkv#t=2.000": (ItemStatus.SUCCEEDED, "strict:1", None),
        "clip.mkv#t=3.000": (ItemStatus.SUCCEEDED, "colours:1", REFUSED),
    }
    found = counts(runtime, job_id)
    assert (found.total, found.succeeded, found.fell_back) == (4, 4, 2)
