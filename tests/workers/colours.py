"""The tiny real classifier the worker tests register, as model `colours`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.app.catalog.catalog import register_model
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.workers.runtime import WorkerRuntime
from tests.models import colour_classifier

MODEL = "colours"


def register_colours(runtime: WorkerRuntime, tmp_path: Path) -> None:
    path = tmp_path / "colours.onnx"
    colour_classifier(path)
    spec = ImageModelSpec(
        input_size=32,
        labels=["red", "green", "blue", "dark"],
        mean=(0, 0, 0),
        std=(1, 1, 1),
        top_k=2,
    )
    with runtime.sessions() as session:
        register_model(
            session,
            runtime.store,
            tenant="",
            name=MODEL,
            data=path.read_bytes(),
            kind="classify",
            spec=spec,
        )
        session.commit()


@contextmanager
def colours_runtime(settings: Settings, tmp_path: Path) -> Iterator[WorkerRuntime]:
    """A worker runtime with `colours` registered, closed after the block."""
    runtime = WorkerRuntime(settings)
    try:
        register_colours(runtime, tmp_path)
        yield runtime
    finally:
        runtime.close()
