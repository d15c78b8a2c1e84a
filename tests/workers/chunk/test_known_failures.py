"""What a pipeline's chunk run remembers of its failures: an input that failed for its own sake
(not an image) is kept as a known failure at its ETag and model version; a failure Kiln caused
(a model that would not load, an item given up on) is not, so the next run tries it again."""

from __future__ import annotations

from sqlalchemy import select, update

from devstack.images import solid
from kiln.app.db.leases import LeasedItem
from kiln.app.db.models import Item, Job, Model, Pipeline, PipelineObject
from kiln.workers.chunk.rows import ChunkRows
from kiln.workers.runtime import WorkerRuntime
from tests.workers.chunk.test_run import RED, run_all, submit
from tests.workers.colours import MODEL

FILES = [("good.png", solid(RED)), ("notes.txt", b"these are not pixels")]


def _as_pipeline_run(runtime: WorkerRuntime, job_id: str) -> int:
    """Make the job a run of a pipeline that has seen its items' keys (ETag "e-KEY")."""
    with runtime.sessions() as session:
        pipeline = Pipeline(tenant="acme", name="nightly", source={"s3": "s3://p/"}, model=MODEL)
        session.add(pipeline)
        session.flush()
        keys = session.scalars(select(Item.key).where(Item.job_id == job_id)).all()
        for key in keys:
            session.add(PipelineObject(pipeline_id=pipeline.id, key=key, etag=f"e-{key}",
                                       seen_job=job_id))  # fmt: skip
            session.execute(
                update(Item).where(Item.job_id == job_id, Item.key == key).values(etag=f"e-{key}")
            )
        session.execute(update(Job).where(Job.id == job_id).values(pipeline_id=pipeline.id))
        session.commit()
        return pipeline.id


def _objects(runtime: WorkerRuntime) -> dict[str, tuple[str | None, ...]]:
    with runtime.sessions() as session:
        rows = session.scalars(select(PipelineObject)).all()
        return {o.key: (o.done_etag, o.failed_etag, o.failed_model) for o in rows}


def test_an_input_s_own_failure_is_remembered_at_its_etag_and_model(
    runtime: WorkerRuntime,
) -> None:
    job_id, calls = submit(runtime, FILES)
    _as_pipeline_run(runtime, job_id)

    run_all(runtime, calls)

    ref = f"{MODEL}:1"
    assert _objects(runtime) == {
        "good.png": ("e-good.png", None, None),
        "notes.txt": (None, "e-notes.txt", ref),
    }


def test_a_model_that_cannot_load_leaves_no_known_failure(runtime: WorkerRuntime) -> None:
    job_id, calls = submit(runtime, FILES)
    _as_pipeline_run(runtime, job_id)
    with runtime.sessions() as session:
        onnx_key = session.scalars(select(Model.onnx_key)).one()
    runtime.store.put(onnx_key, b"tampered")  # no longer matches the recorded sha256

    run_all(runtime, calls)

    # the model loads before anything is read: neither input was tried, neither is known
    assert _objects(runtime) == {"good.png": (None, None, None), "notes.txt": (None, None, None)}


def test_rows_given_up_on_or_cancelled_are_no_input_failures() -> None:
    items = [
        LeasedItem(i, "job", key, f"store:{key}", None, chunk=0, attempts=1)
        for i, key in enumerate(["a", "b", "c", "d", "e"])
    ]
    rows = ChunkRows(items)
    rows.fail(0, "not an image")
    rows.fail(1, "Kiln gave up on this input after 20 attempts", blameless=True)
    rows.fail(2, "not an image")
    rows.cancelled[2] = True
    rows.fail(4, "refused by the model")

    assert rows.input_failures() == ["a", "e"]
    assert rows.without([0]).input_failures() == ["e"]
