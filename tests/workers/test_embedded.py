"""`kiln run` in process: files read where they are, any number of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from devstack.images import solid
from kiln.workers.embedded import run_embedded
from tests.support import migrated_settings


def test_a_folder_larger_than_the_api_job_cap_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for name in ("a.png", "b.png", "sub/c.png"):
        (folder / name).write_bytes(solid((200, 30, 30)))
    settings = migrated_settings(tmp_path, monkeypatch, max_files_per_job=2)

    outcome = run_embedded(settings, str(folder), "detector")

    assert outcome.progress.job.status == "completed"
    assert outcome.progress.counts.succeeded == 3
    assert sorted(outcome.table.column("key").to_pylist()) == ["a.png", "b.png", "sub/c.png"]
    objects = Path(settings.storage_url.removeprefix("file://"))
    assert not list(objects.glob("jobs/*/inputs/*"))  # nothing was copied


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    from devstack.images import near_copy, photo

    images = tmp_path / "photos"
    images.mkdir()
    a = photo(70)
    for name, data in (("a.jpg", a), ("a-copy.jpg", near_copy(a)), ("b.jpg", photo(71))):
        (images / name).write_bytes(data)
    return images


def test_kiln_run_detector_and_phash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch)
    detected = run_embedded(settings, str(folder), "detector")
    assert detected.progress.counts.succeeded == 3 and "detections" in detected.table.column_names
    hashed = run_embedded(settings, str(folder), "phash").table.to_pylist()
    group = {row["key"]: row["group"] for row in hashed}
    assert group["a.jpg"] == group["a-copy.jpg"] is not None and group["b.jpg"] is None


def test_kiln_run_registered_classify_and_embed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiln.app.catalog.catalog import register_model
    from kiln.app.catalog.model_spec import ImageModelSpec
    from kiln.app.db.session import make_engine, make_session_factory
    from kiln.app.storage import open_store
    from tests.models import colour_classifier

    settings = migrated_settings(tmp_path, monkeypatch)
    onnx_path = tmp_path / "colours.onnx"
    colour_classifier(onnx_path)
    base = {"input_size": 32, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
    engine = make_engine(settings.database_url)
    with make_session_factory(engine)() as session:
        for name, kind, spec in (
            ("colours", "classify", ImageModelSpec(labels=["r", "g", "b", "dark"], **base)),
            ("colour-vectors", "embed", ImageModelSpec(**base)),
        ):
            register_model(session, open_store(settings), tenant="", name=name,
                           data=onnx_path.read_bytes(), kind=kind, spec=spec)  # fmt: skip
        session.commit()
    engine.dispose()
    folder = tmp_path / "colours"
    folder.mkdir()
    (folder / "red.png").write_bytes(solid((230, 20, 20)))

    labels = run_embedded(settings, str(folder), "colours").table.to_pylist()
    assert labels[0]["labels"][0]["label"] == "r"
    vectors = run_embedded(settings, str(folder), "colour-vectors").table.to_pylist()
    assert len(vectors[0]["embedding"]) == 4 and vectors[0]["dim"] == 4


def test_kiln_run_text_embed_reads_a_file_of_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = migrated_settings(tmp_path, monkeypatch)
    texts = tmp_path / "texts.txt"
    texts.write_text("A man is eating food.\n\nA man is eating a piece of bread.\n")
    table = run_embedded(settings, str(texts), "text-embed").table.to_pylist()
    assert [row["key"] for row in table] == ["line-000001", "line-000003"]  # the blank is skipped
    food, bread = (row["embedding"] for row in table)
    assert abs(sum(x * y for x, y in zip(food, bread, strict=True)) - 0.7553) < 1e-3


def test_a_text_model_on_a_folder_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    from kiln.app.core.errors import InputError

    settings = migrated_settings(tmp_path, monkeypatch)
    with pytest.raises(InputError, match="one input per line"):
        run_embedded(settings, str(folder), "text-embed")


def test_a_stop_asked_for_cancels_the_job_and_keeps_what_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kiln run`'s Ctrl-C without the signal: the event set at the first report (the job just
    submitted, one chunk at a time) cancels the job, and the run waits for it to close."""
    import threading

    folder = tmp_path / "photos"
    folder.mkdir()
    for n in range(40):
        (folder / f"{n:02d}.png").write_bytes(solid((n * 6, 30, 30)))
    settings = migrated_settings(
        tmp_path, monkeypatch, chunk_size=2, worker_concurrency=1, prep_processes=0
    )
    stop = threading.Event()
    outcome = run_embedded(settings, str(folder), "phash", lambda _p: stop.set(), cancel=stop)

    counts = outcome.progress.counts
    assert outcome.cancelled and outcome.progress.job.status == "cancelled"
    assert counts.cancelled > 20 and counts.pending == 0
    assert counts.succeeded + counts.failed + counts.cancelled == counts.total == 40
    rows = outcome.table.to_pylist()
    assert all(r["phash"] is not None for r in rows if r["status"] == "succeeded")
    assert sum(r["status"] == "succeeded" for r in rows) == counts.succeeded


def test_a_stop_asked_for_before_the_submit_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    import threading

    from kiln.workers.embedded import Interrupted

    settings = migrated_settings(tmp_path, monkeypatch)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Interrupted):
        run_embedded(settings, str(folder), "phash", cancel=stop)
