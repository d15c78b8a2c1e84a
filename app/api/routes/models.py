"""/v1/models: what a job can name."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import SessionDep, TenantDep
from app.api.schemas import ModelOut
from app.catalog import list_models

router = APIRouter(prefix="/v1/models", tags=["models"])


@router.get("", response_model=list[ModelOut])
def get_models(session: SessionDep, _tenant: TenantDep) -> list[ModelOut]:
    return [
        ModelOut(
            name=m.name, kind=m.kind, input=m.input, description=m.description, builtin=m.builtin
        )
        for m in list_models(session)
    ]
