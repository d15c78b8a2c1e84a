"""`kiln models add`: a spec the graph contradicts is refused with its sentence."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from kiln.app.catalog.catalog import get_model
from kiln.app.cli.commands import app
from kiln.app.core.config import Settings
from tests.models import colour_classifier
from tests.workers.models.yolo import tiny_yolo


@pytest.fixture
def kiln(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("KILN_DATA_DIR", str(settings.data_dir))
    return CliRunner()


@pytest.fixture
def colours(tmp_path: Path) -> list[str]:
    """`kiln models add` arguments for the 32×32 colour classifier, but for --input-size."""
    colour_classifier(tmp_path / "colours.onnx")
    (tmp_path / "labels.txt").write_text("red\ngreen\nblue\ndark\n")
    onnx, labels = str(tmp_path / "colours.onnx"), str(tmp_path / "labels.txt")
    return ["models", "add", "colours", "--onnx", onnx, "--labels", labels,
            "--mean", "0,0,0", "--std", "1,1,1"]  # fmt: skip


def test_an_input_size_the_graph_contradicts(kiln: CliRunner, colours: list[str]) -> None:
    done = kiln.invoke(app, colours)  # the default --input-size is 224
    assert done.exit_code == 1
    assert " ".join(done.output.split()) == (
        "error: The model's input is 32 pixels a side, but input_size is 224; "
        "register it with input_size 32."
    )
    added = kiln.invoke(app, [*colours, "--input-size", "32"])
    assert added.exit_code == 0 and "model colours:1 (classify) registered" in added.output


def test_a_detector_with_declared_preprocessing(
    kiln: CliRunner, tmp_path: Path, sessions: sessionmaker[Session]
) -> None:
    tiny_yolo(tmp_path / "yolo.onnx")
    (tmp_path / "labels.txt").write_text("red\nblue\n")
    args = ["models", "add", "boxes", "--kind", "detect", "--onnx", str(tmp_path / "yolo.onnx"),
            "--labels", str(tmp_path / "labels.txt"), "--input-size", "32"]  # fmt: skip
    refused = kiln.invoke(app, [*args, "--fit", "crop"])
    assert refused.exit_code == 1
    assert "its fit must be letterbox or squash" in " ".join(refused.output.split())
    added = kiln.invoke(
        app, [*args, "--resize-filter", "bicubic", "--channel-order", "bgr", "--max-boxes", "20"]
    )
    assert added.exit_code == 0 and "model boxes:1 (detect) registered" in added.output
    with sessions() as db:
        stored = get_model(db, "boxes", "").spec
    assert (stored["fit"], stored["resize_filter"], stored["channel_order"]) == (
        "letterbox", "bicubic", "BGR"
    )  # fmt: skip
    assert (stored["max_boxes"], stored["mean"]) == (20, [0.0, 0.0, 0.0])
