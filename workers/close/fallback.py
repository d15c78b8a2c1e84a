"""A job's fallback model as a chunk run sees it: which of the job's model's failures it takes,
and the Parquet columns of a job whose rows two models may answer.

The option is checked, and its model pinned to one version, when the job is submitted
(`kiln.app.catalog.fallback`); the re-run itself is part of the chunk run (`workers/chunk/run.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.families.fallback import FallbackOptions
from kiln.workers.models.loader import output_fields
from kiln.workers.runtime import WorkerRuntime


@dataclass(frozen=True)
class Fallback:
    model: ModelInfo
    on: frozenset[str]  # "failed", "refused": the failures of the job's model it takes

    def takes(self, failure: str | None) -> bool:
        return failure is not None and failure in self.on


def job_fallback(
    runtime: WorkerRuntime, session: Session, tenant: str, options: Mapping[str, Any] | None
) -> Fallback | None:
    """The job's fallback, if its options name one."""
    raw = (options or {}).get("fallback")
    if raw is None:
        return None
    declared = FallbackOptions.model_validate(raw)
    return Fallback(runtime.model_info(session, declared.model, tenant), frozenset(declared.on))


def shard_fields(model: ModelInfo, fallback: Fallback | None) -> list[pa.Field]:
    """The model's output columns, then the fallback's that it lacks (a column both have keeps
    the job's model's type)."""
    fields = output_fields(model)
    if fallback is None:
        return fields
    names = {f.name for f in fields}
    return fields + [f for f in output_fields(fallback.model) if f.name not in names]
