"""A job's fallback model against the catalog: every refusal is a 422 sentence at submission,
for jobs, bulk jobs and schedules alike, and an accepted fallback is pinned to its version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import register_model
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError
from kiln.app.db.models import Job, Schedule
from kiln.app.dispatch.stub import RecordingDispatcher
from kiln.app.jobs.ingest import BulkRequest, Source, submit_bulk
from kiln.app.jobs.jobs import InputRef, JobRequest, Upload, submit_job
from kiln.app.jobs.schedules import ScheduleRequest, add_schedule
from kiln.app.storage.local import LocalStore
from kiln.app.tenants.tenants import allow_bucket
from tests.models import colour_classifier

COLOURS = ImageModelSpec(
    input_size=32, labels=["red", "green", "blue", "dark"], mean=(0, 0, 0), std=(1, 1, 1)
)


@pytest.fixture(autouse=True)
def _models(session: Session, store: LocalStore, tmp_path: Path) -> None:
    """`colours` (two versions) and `embedder` for every tenant, `secret` for globex only."""
    path = tmp_path / "c.onnx"
    colour_classifier(path)
    data = path.read_bytes()
    for tenant, name, kind in [
        ("", "colours", "classify"),
        ("", "colours", "classify"),
        ("", "embedder", "embed"),
        ("globex", "secret", "classify"),
    ]:
        register_model(session, store, tenant=tenant, name=name, data=data, kind=kind, spec=COLOURS)
    allow_bucket(session, "acme", "photos")
    session.commit()


def submit(
    session: Session,
    store: LocalStore,
    settings: Settings,
    model: str,
    fallback: Any,
    text: bool = False,
) -> Job:
    request = JobRequest(
        tenant="acme",
        model=model,
        uploads=[] if text else [Upload("a.png", b"\x89PNG")],
        inputs=[InputRef(text="hello")] if text else [],
        options={"fallback": fallback},
    )
    return submit_job(session, store, RecordingDispatcher(), settings, request).job


def test_an_accepted_fallback_is_pinned_to_its_version(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    job = submit(session, store, settings, "detector", {"model": "colours", "on": ["refused"]})
    assert job.options == {"fallback": {"model": "colours:2", "on": ["refused"]}}
    job = submit(session, store, settings, "colours:1", {"model": "detector"})
    assert job.options == {"fallback": {"model": "detector"}}  # a built-in has no version


@pytest.mark.parametrize(
    ("model", "fallback", "sentence"),
    [
        ("detector", {"model": "nothing"}, "The fallback of model 'detector' is not a model you "
         "can use. There is no model named 'nothing'; available models: detector,"),
        ("detector", {"model": "secret"}, "The fallback of model 'detector' is not a model you "
         "can use. There is no model named 'secret';"),  # globex's: acme cannot tell it exists
        ("detector", {"model": "bad name!"}, "'bad name!' is not a model name"),
        ("detector", {"model": "detector"}, "Model 'detector' cannot be its own fallback, in any "
         "version; name another model."),
        ("colours:2", {"model": "colours:1"}, "Model 'colours' cannot be its own fallback"),
        ("colours", {"model": "colours:2"}, "Model 'colours' cannot be its own fallback"),
        ("detector", {"model": "text-embed"}, "The fallback model 'text-embed' takes text, but "
         "'detector' takes images; a fallback must take the same inputs."),
        ("embedder", {"model": "embedder", "fallback": {"model": "phash"}},
         "A fallback model cannot have a fallback of its own"),
        ("detector", {"model": "ocr", "on": ["crashed"]}, "Option 'fallback.on' of model"),
    ],
)  # fmt: skip
def test_a_fallback_that_cannot_work_is_refused(
    session: Session,
    store: LocalStore,
    settings: Settings,
    model: str,
    fallback: dict[str, Any],
    sentence: str,
) -> None:
    with pytest.raises(InputError) as refused:
        submit(session, store, settings, model, fallback)
    assert sentence in str(refused.value)
    assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_a_text_model_refuses_an_image_fallback(
    session: Session, store: LocalStore, settings: Settings
) -> None:
    with pytest.raises(InputError, match="'ocr' takes images, but 'text-embed' takes text"):
        submit(session, store, settings, "text-embed", {"model": "ocr"}, text=True)


def test_an_embedder_cannot_stand_in_for_another(
    session: Session, store: LocalStore, settings: Settings, tmp_path: Path
) -> None:
    path = tmp_path / "e.onnx"
    colour_classifier(path)
    register_model(
        session, store, tenant="acme", name="other-embedder", data=path.read_bytes(),
        kind="embed", spec=COLOURS,
    )  # fmt: skip
    session.commit()
    with pytest.raises(InputError, match="vectors compare only with the same model's"):
        submit(session, store, settings, "embedder", {"model": "other-embedder"})
    assert submit(session, store, settings, "embedder", {"model": "phash"}).options


def test_bulk_jobs_check_and_pin_the_fallback_too(session: Session) -> None:
    dispatcher = RecordingDispatcher()
    request = BulkRequest("acme", "phash", Source("s3://photos/"), options={})
    with pytest.raises(InputError, match="'phash' cannot be its own fallback"):
        submit_bulk(
            session, dispatcher, BulkRequest(**{**request.__dict__, "options": {"fallback": {
                "model": "phash"}}}),
        )  # fmt: skip
    good = BulkRequest(**{**request.__dict__, "options": {"fallback": {"model": "colours"}}})
    job = submit_bulk(session, dispatcher, good).job
    assert job.options == {"fallback": {"model": "colours:2"}}


def test_a_schedule_checks_its_fallback_and_keeps_it_as_asked(session: Session) -> None:
    request = ScheduleRequest("acme", "nightly", "0 2 * * *", Source("s3://photos/"), "phash")
    with pytest.raises(InputError, match="There is no model named 'secret'"):
        add_schedule(session, ScheduleRequest(**{**request.__dict__, "options": {"fallback": {
            "model": "secret"}}}))  # fmt: skip
    asked = {"fallback": {"model": "colours"}}  # each run pins the latest version then
    schedule = add_schedule(session, ScheduleRequest(**{**request.__dict__, "options": asked}))
    assert session.get(Schedule, schedule.id) is not None and schedule.options == asked
