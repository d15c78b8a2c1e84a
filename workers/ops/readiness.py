"""Worker readiness for probes: a file that exists only while the worker takes tasks.

`kiln worker --ready-file PATH [--warm MODEL,...]` removes PATH at start, builds the named
built-in models' engines once the worker is connected (so the first chunk does not pay the
engine build), then writes PATH; a warm shutdown removes it first. A Kubernetes readinessProbe
(`test -f PATH`) or a compose healthcheck reads it; no port, no HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from celery.signals import worker_ready, worker_shutting_down

log = logging.getLogger(__name__)


def parse_models(names: str | None) -> list[str]:
    return [name.strip() for name in (names or "").split(",") if name.strip()]


def install(path: Path, warm_up: Callable[[], Sequence[str]]) -> Callable[[], None]:
    """Write `path` after `warm_up()` once the worker is ready; remove it on shutdown.
    Returns the function that disconnects both."""
    path.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)

    def ready(**_: Any) -> None:
        warmed = warm_up()
        path.write_text("ready " + " ".join(warmed) + "\n")
        log.info("worker ready (warmed: %s); wrote %s", ", ".join(warmed) or "nothing", path)

    def stopping(**_: Any) -> None:
        path.unlink(missing_ok=True)

    worker_ready.connect(ready, weak=False)
    worker_shutting_down.connect(stopping, weak=False)

    def uninstall() -> None:
        worker_ready.disconnect(ready)
        worker_shutting_down.disconnect(stopping)

    return uninstall


def warm_models(runtime: Callable[[], Any], names: Sequence[str]) -> Callable[[], list[str]]:
    """A warm-up that builds each built-in model's predictor (and its engine) in this process."""

    def warm_up() -> list[str]:
        from kiln.app.catalog.catalog import builtin_model

        for name in names:
            runtime().models.runner(builtin_model(name))
        return list(names)

    return warm_up
