"""A job's fallback model, checked against the catalog when the job (or bulk job, or schedule)
is submitted: a model the tenant can use, not the job's own model in any version, no chain,
taking the same inputs. The option's shape is the families' (`kiln.app.families.fallback`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from kiln.app.catalog.catalog import ModelInfo, get_model
from kiln.app.core.errors import InputError, NotFoundError
from kiln.app.families import FAMILIES
from kiln.app.families.fallback import FallbackOptions

_TAKES = {"image": "images", "text": "text"}


def check_fallback(
    session: Session, tenant: str, model: ModelInfo, options: dict[str, Any]
) -> dict[str, Any]:
    """`options` (already checked against the family) with the fallback pinned to the exact
    version it names now, as the job's own model is; an InputError (422) with a sentence if the
    pair cannot work."""
    raw = options.get("fallback")
    if raw is None:
        return options
    fallback = _fallback_model(session, tenant, model, FallbackOptions.model_validate(raw).model)
    if fallback.name == model.name:
        raise InputError(
            f"Model {model.name!r} cannot be its own fallback, in any version; name another model."
        )
    if fallback.input != model.input:
        raise InputError(
            f"The fallback model {fallback.name!r} takes {_TAKES[fallback.input]}, but "
            f"{model.name!r} takes {_TAKES[model.input]}; a fallback must take the same inputs."
        )
    if FAMILIES[fallback.kind].vectors and FAMILIES[model.kind].vectors:
        raise InputError(
            f"Embeddings of {fallback.name!r} cannot stand in for those of {model.name!r}: "
            "vectors compare only with the same model's; choose a fallback that is not an "
            "embedder."
        )
    return {**options, "fallback": {**raw, "model": fallback.ref}}


def _fallback_model(session: Session, tenant: str, model: ModelInfo, ref: str) -> ModelInfo:
    try:
        return get_model(session, ref, tenant)
    except NotFoundError as error:  # another tenant's model is "no model" too: nothing leaks
        raise InputError(
            f"The fallback of model {model.name!r} is not a model you can use. {error}"
        ) from None
