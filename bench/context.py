"""What every case gets: the plan, generated inputs and models, and the running services."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.plan import Plan
from bench.results import CaseResult
from bench.stack import Registered, Stack


@dataclass
class Context:
    plan: Plan
    workdir: Path
    log_dir: Path
    images: list[Path]
    small_images: list[Path]
    models: dict[str, Registered]
    stack: Stack | None = None
    uris: dict[str, list[str]] = field(default_factory=dict)
    raw: dict[str, CaseResult] = field(default_factory=dict)  # the sweep's best, per model

    @property
    def image_folder(self) -> Path:
        return self.images[0].parent

    def require_stack(self) -> Stack:
        if self.stack is None:
            raise RuntimeError("This case needs the services stack, which was not started.")
        return self.stack
