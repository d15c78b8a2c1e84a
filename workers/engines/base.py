"""The `Engine` protocol every backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int | str | None, ...]
    dtype: str


class Engine(Protocol):
    """Runs one model on whole batches; `infer` is called from the Batcher's runner threads."""

    backend: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch: int

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
