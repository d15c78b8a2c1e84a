"""Which models a job can name: the built-ins shipped by packages, plus registered ONNX files."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import ConflictError, InputError, NotFoundError
from app.db.models import Model
from app.storage import ObjectStore

KINDS = ("detect", "ocr", "classify")
REGISTRABLE_KINDS = ("classify",)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    kind: str
    input: str  # "image" or "text"
    description: str
    builtin: bool
    spec: dict[str, Any] = field(default_factory=dict)
    onnx_key: str | None = None
    sha256: str | None = None


BUILTIN_MODELS: dict[str, ModelInfo] = {
    "detector": ModelInfo(
        "detector",
        "detect",
        "image",
        "YOLOv8n detector (320 px) shipped by nudenet: labelled boxes in image pixels.",
        builtin=True,
    ),
    "ocr": ModelInfo(
        "ocr",
        "ocr",
        "image",
        "PP-OCRv4 text detection and recognition shipped by rapidocr-onnxruntime.",
        builtin=True,
    ),
}


def _from_row(row: Model) -> ModelInfo:
    return ModelInfo(
        name=row.name,
        kind=row.kind,
        input="image",
        description=str(row.spec.get("description") or f"Registered {row.kind} model."),
        builtin=False,
        spec=dict(row.spec),
        onnx_key=row.onnx_key,
        sha256=row.sha256,
    )


def list_models(session: Session) -> list[ModelInfo]:
    rows = session.scalars(select(Model).order_by(Model.name)).all()
    return [*BUILTIN_MODELS.values(), *(_from_row(r) for r in rows)]


def get_model(session: Session, name: str) -> ModelInfo:
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    row = session.scalar(select(Model).where(Model.name == name))
    if row is None:
        known = ", ".join(m.name for m in list_models(session))
        raise NotFoundError(f"There is no model named {name!r}; available models: {known}.")
    return _from_row(row)


@dataclass(frozen=True)
class ClassifierSpec:
    input_size: int
    labels: list[str]
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    top_k: int = 5
    description: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_size": self.input_size,
            "labels": self.labels,
            "mean": list(self.mean),
            "std": list(self.std),
            "top_k": self.top_k,
            "layout": "NCHW",
            "description": self.description,
        }


def register_model(
    session: Session,
    store: ObjectStore,
    name: str,
    onnx_path: Path,
    kind: str,
    spec: ClassifierSpec,
) -> ModelInfo:
    """Copy the ONNX file into object storage (so any worker can fetch it) and record it."""
    if kind not in REGISTRABLE_KINDS:
        raise InputError(f"Kind {kind!r} cannot be registered; use one of {REGISTRABLE_KINDS}.")
    if name in BUILTIN_MODELS or session.scalar(select(Model.id).where(Model.name == name)):
        raise ConflictError(f"A model named {name!r} already exists.")
    data = onnx_path.read_bytes()
    _check_onnx(data, spec)
    sha256 = hashlib.sha256(data).hexdigest()
    key = f"models/{name}/{sha256}.onnx"
    store.put(key, data, "application/octet-stream")
    row = Model(name=name, kind=kind, onnx_key=key, sha256=sha256, spec=spec.as_dict())
    session.add(row)
    session.flush()
    return _from_row(row)


def _check_onnx(data: bytes, spec: ClassifierSpec) -> None:
    import onnx

    try:
        graph = onnx.load_from_string(data).graph
    except Exception as error:  # onnx raises DecodeError and friends
        raise InputError(f"The file is not a readable ONNX model: {error}.") from None
    inputs = [i for i in graph.input if i.name not in {t.name for t in graph.initializer}]
    if len(inputs) != 1 or len(inputs[0].type.tensor_type.shape.dim) != 4:
        raise InputError("A classifier must take one 4-D image input, [N, 3, H, W].")
    if not spec.labels:
        raise InputError("A classifier needs labels: pass --labels FILE with one per line.")
