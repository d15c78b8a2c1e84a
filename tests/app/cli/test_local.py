"""`kiln run`: a refused run prints its sentence and no progress bar; a good one draws it."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from devstack.images import solid
from kiln.app.cli import common
from kiln.app.cli.commands import app
from kiln.app.core.config import Settings

BAR = "━"  # what the progress bar is drawn with


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    """The `kiln` command on the test's data dir (`settings` cleared every other KILN_*)."""
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    # Rich wraps at the console's width, a long path at its "/" (and under xdist the width is
    # fixed at 80 when the module imports): the sentences are read unwrapped
    monkeypatch.setattr(common.errors, "soft_wrap", True)
    return CliRunner()


@pytest.fixture
def photos(tmp_path: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "red.png").write_bytes(solid((230, 20, 20)))
    return folder


def refused(kiln: CliRunner, *args: str) -> str:
    """Run `kiln run …`, expect exit 1, and return the output as one line."""
    done = kiln.invoke(app, ["run", *args])
    assert done.exit_code == 1, done.output
    assert BAR not in done.output, done.output
    text = " ".join(done.output.split())  # Rich wraps long sentences at the console width
    assert text.startswith("error: ") and text.endswith("."), done.output
    return text


def test_a_path_that_is_not_there(kiln: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    text = refused(kiln, str(missing), "--model", "detector")
    assert f"'{missing}' does not exist" in text


def test_an_absolute_glob_that_matches_nothing(kiln: CliRunner, tmp_path: Path) -> None:
    pattern = f"{tmp_path}/nowhere/*.jpg"  # pathlib alone refuses absolute patterns
    found = refused(kiln, pattern, "--model", "detector")
    assert f"No images or videos found at '{pattern}'" in found


def test_a_folder_with_no_images(kiln: CliRunner, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not an image\n")
    assert f"No images or videos found at '{empty}'" in refused(
        kiln, str(empty), "--model", "detector"
    )


def test_an_unknown_model(kiln: CliRunner, photos: Path) -> None:
    text = refused(kiln, str(photos), "--model", "nope")
    assert "There is no model named 'nope'; available models:" in text


def test_a_text_model_given_images(kiln: CliRunner, photos: Path) -> None:
    on_folder = refused(kiln, str(photos), "--model", "text-embed")
    assert f"'{photos}' is not a file; a text model reads one input per line" in on_folder
    on_image = refused(kiln, str(photos / "red.png"), "--model", "text-embed")
    assert "is an image; a text model reads a UTF-8 file with one input per line" in on_image


def test_an_empty_text_file(kiln: CliRunner, tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("\n  \n")
    assert "has no non-empty line" in refused(kiln, str(texts), "--model", "text-embed")


def test_an_output_that_cannot_be_written_is_refused_before_the_run(
    kiln: CliRunner, photos: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    nowhere = blocker / "out.parquet"
    text = refused(kiln, str(photos), "--model", "phash", "-o", str(nowhere))
    assert f"the folder '{blocker}' cannot be made" in text
    folder = refused(kiln, str(photos), "--model", "phash", "-o", str(tmp_path))
    assert "is a folder; name a .parquet file" in folder
    dangling = tmp_path / "results.parquet"
    dangling.symlink_to(tmp_path / "gone" / "results.parquet")  # a link to nowhere
    broken = refused(kiln, str(photos), "--model", "phash", "-o", str(dangling))
    assert f"--output '{dangling}' cannot be written (No such file or directory)" in broken


def test_a_good_run_draws_the_bar_then_the_summary(
    kiln: CliRunner, photos: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out.parquet"
    done = kiln.invoke(app, ["run", str(photos), "--model", "phash", "-o", str(output)])
    assert done.exit_code == 0, done.output
    bar_at = done.output.index(BAR)
    assert done.output.index("results:") > bar_at and "1/1" in done.output
    assert pq.read_table(output).column("key").to_pylist() == ["red.png"]


def test_an_unknown_option_is_refused_with_the_family_sentence(
    kiln: CliRunner, photos: Path
) -> None:
    text = refused(kiln, str(photos), "--model", "phash", "--option", "max_distnace=8")
    assert (
        "Model 'phash' has no option 'max_distnace'; its options are 'max_distance', 'fallback'."
        in text
    )


def test_an_option_reaches_the_job(kiln: CliRunner, photos: Path, settings: Settings) -> None:
    from sqlalchemy import select

    from kiln.app.db.models import Job
    from kiln.app.db.session import make_engine, make_session_factory

    out = photos.parent / "hashes.parquet"
    done = kiln.invoke(
        app, ["run", str(photos), "--model", "phash", "--option", "max_distance=3", "-o", str(out)]
    )
    assert done.exit_code == 0, done.output
    with make_session_factory(make_engine(settings.database_url))() as session:
        assert session.scalars(select(Job.options)).one() == {"max_distance": 3}


def test_an_output_in_a_new_folder_gets_its_folder(
    kiln: CliRunner, photos: Path, tmp_path: Path
) -> None:
    output = tmp_path / "new" / "deeper" / "out.parquet"  # as `make demo` asks on a fresh clone
    done = kiln.invoke(app, ["run", str(photos), "--model", "phash", "-o", str(output)])
    assert done.exit_code == 0, done.output
    assert pq.read_table(output).num_rows == 1


def one_line(output: str) -> str:
    return " ".join(output.split())  # Rich wraps long sentences at the console width


def test_a_plain_run_says_it_runs_here(kiln: CliRunner, photos: Path, settings: Settings) -> None:
    done = kiln.invoke(app, ["run", str(photos), "--model", "phash", "-o", str(photos / "o.pq")])
    assert done.exit_code == 0, done.output
    said = f"Running here, embedded (SQLite and files under {settings.data_dir})."
    assert said in one_line(done.output)
    assert done.output.index("Running here") < done.output.index(BAR)


def test_a_service_in_the_environment_is_not_used(
    kiln: CliRunner, photos: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The variables of "As a service" exported, and nothing answers at them: the run is
    still this process's own, and says which service it leaves alone (its password hidden)."""
    monkeypatch.setenv("KILN_DATABASE_URL", "postgresql+psycopg://kiln:secret@127.0.0.1:1/kiln")
    monkeypatch.setenv("KILN_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("KILN_STORAGE_URL", "s3://nowhere/kiln")
    output = photos.parent / "out.parquet"
    done = kiln.invoke(app, ["run", str(photos), "--model", "phash", "-o", str(output)])
    assert done.exit_code == 0, done.output
    assert (
        f"Running here, embedded (SQLite and files under {settings.data_dir}); the service at "
        "postgresql+psycopg://kiln:***@127.0.0.1:1/kiln, redis://127.0.0.1:1/0 and "
        "s3://nowhere/kiln is not used — `kiln submit` sends to it." in one_line(done.output)
    )
    assert "secret" not in done.output
    assert pq.read_table(output).column("status").to_pylist() == ["succeeded"]
    assert (settings.data_dir / "kiln.db").is_file()


def test_a_run_where_no_item_succeeded_exits_1_after_its_summary(
    kiln: CliRunner, tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        (folder / name).write_bytes(b"not an image at all")
    output = tmp_path / "out.parquet"
    done = kiln.invoke(app, ["run", str(folder), "--model", "phash", "-o", str(output)])
    assert done.exit_code == 1, done.output
    text = one_line(done.output)
    assert "completed" in text and "results:" in text  # the summary, then the verdict
    assert f"error: no item succeeded (2 of 2 failed; each error is in {output})." in text
    assert text.index("results:") < text.index("error: no item succeeded")
    assert pq.read_table(output).column("status").to_pylist() == ["failed", "failed"]


def test_a_run_where_some_items_failed_exits_0(kiln: CliRunner, photos: Path) -> None:
    (photos / "broken.png").write_bytes(b"not an image at all")
    output = photos.parent / "out.parquet"
    done = kiln.invoke(app, ["run", str(photos), "--model", "phash", "-o", str(output)])
    assert done.exit_code == 0, done.output
    assert "error:" not in done.output
    rows = pq.read_table(output).to_pylist()
    statuses = {r["key"]: r["status"] for r in rows}
    assert statuses == {"broken.png": "failed", "red.png": "succeeded"}
