"""/v1/models: what a job can name, and registering your own ONNX models."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from sqlalchemy.orm import Session
from starlette.datastructures import FormData, UploadFile

from kiln.app.api.deps import ContextDep, S3Dep, SessionDep, TenantDep
from kiln.app.api.errors import RequestTooLargeError, error_responses, validation_sentence
from kiln.app.api.schemas import EngineOut, ModelCreate, ModelOut, ModelSpecIn
from kiln.app.catalog.catalog import (
    REGISTRABLE_KINDS,
    ModelInfo,
    get_model,
    list_models,
    model_versions,
    register_model,
)
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.core.errors import InputError
from kiln.app.db import queries
from kiln.app.storage.base import S3Factory
from kiln.app.storage.s3 import read_object
from kiln.app.tenants.tenants import check_bucket

router = APIRouter(prefix="/v1/models", tags=["models"])

ERRORS = error_responses(401, 403, 404, 409, 413, 422, 429, 503)


def model_out(session: Session, tenant: str, info: ModelInfo) -> ModelOut:
    """`info` with its registered versions and the engines workers reported for it."""
    out = ModelOut.model_validate(info)
    out.versions = [] if info.builtin else model_versions(session, tenant, info.name)
    out.engines = [EngineOut.model_validate(e) for e in queries.engine_reports(session, [info.ref])]
    return out


@router.get("", response_model=list[ModelOut], responses=ERRORS)
def get_models(session: SessionDep, tenant: TenantDep) -> list[ModelOut]:
    """Built-in models, then the latest version of each model you (or an operator) registered."""
    return [model_out(session, tenant, m) for m in list_models(session, tenant)]


@router.get("/{ref}", response_model=ModelOut, responses=ERRORS)
def get_one(ref: str, session: SessionDep, tenant: TenantDep) -> ModelOut:
    """One model: `NAME` (its latest version) or `NAME:VERSION`."""
    return model_out(session, tenant, get_model(session, ref, tenant))


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=ModelOut,
    responses={**ERRORS, **error_responses(400)},
    openapi_extra={
        "requestBody": {
            "content": {
                "application/json": {"schema": ModelCreate.model_json_schema()},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["name", "kind", "spec", "file"],
                        "properties": {
                            "name": {"type": "string"},
                            "kind": {"type": "string", "enum": list(REGISTRABLE_KINDS)},
                            "spec": {"type": "string", "description": "A JSON object."},
                            "file": {"type": "string", "format": "binary"},
                        },
                    }
                },
            },
            "required": True,
        }
    },
)
async def create_model(
    request: Request, response: Response, context: ContextDep, s3: S3Dep, tenant: TenantDep
) -> ModelOut:
    """Register an ONNX file (uploaded, or from `s3://`) as the next version of `name`."""
    name, kind, spec, data, source = await _read_model(request, context.settings)

    def register() -> ModelOut:
        with context.sessions() as session:
            onnx = data
            if onnx is None:
                onnx = _from_s3(context.settings, s3, session, tenant, source)
            info = register_model(
                session,
                context.store,
                tenant=tenant,
                name=name,
                data=onnx,
                kind=kind,
                spec=spec,
                source=source,
            )
            return model_out(session, tenant, info)

    out = await run_in_threadpool(register)
    response.headers["Location"] = str(request.url_for("get_one", ref=out.ref))
    return out


def _from_s3(
    settings: Settings, s3: S3Factory, session: Session, tenant: str, source: str | None
) -> bytes:
    if not source or not source.startswith("s3://"):
        raise InputError("'source' must be an s3:// URI of the ONNX file (or upload it).")
    check_bucket(session, tenant, source)  # before Kiln's credentials fetch anything
    return read_object(s3(), source, settings.max_model_bytes)


def _spec(raw: object) -> ImageModelSpec:
    try:
        parsed = ModelSpecIn.model_validate(raw)
    except ValidationError as error:
        raise InputError(validation_sentence(error.errors())) from None
    return ImageModelSpec(**parsed.model_dump())


async def _read_model(
    request: Request, settings: Settings
) -> tuple[str, str, ImageModelSpec, bytes | None, str | None]:
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        try:
            body = ModelCreate.model_validate_json(await request.body())
        except ValidationError as error:
            raise InputError(validation_sentence(error.errors())) from None
        return body.name, body.kind, _spec(body.spec.model_dump()), None, body.source
    if content_type.startswith("multipart/form-data"):
        async with request.form(max_files=1, max_fields=10) as form:
            return await _from_form(form, settings)
    raise InputError("Send the model as application/json (an s3:// source) or multipart/form-data.")


async def _from_form(
    form: FormData, settings: Settings
) -> tuple[str, str, ImageModelSpec, bytes | None, str | None]:
    name, kind, upload = form.get("name"), form.get("kind"), form.get("file")
    if not isinstance(name, str) or not name or kind not in REGISTRABLE_KINDS:
        kinds = ", ".join(REGISTRABLE_KINDS)
        raise InputError(f"The form needs 'name' and 'kind' (one of {kinds}).")
    if not isinstance(upload, UploadFile):
        raise InputError("The form needs the ONNX file as 'file'.")
    try:
        spec = _spec(json.loads(str(form.get("spec") or "{}")))
    except json.JSONDecodeError:
        raise InputError("'spec' must be a JSON object.") from None
    data = await upload.read(settings.max_model_bytes + 1)
    if len(data) > settings.max_model_bytes:
        raise RequestTooLargeError(
            f"The model is over the {settings.max_model_bytes:,}-byte limit."
        )
    return name, str(kind), spec, data, None
