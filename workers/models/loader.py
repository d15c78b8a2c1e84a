"""Build a model family's predictor inside the worker process that will run it."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.catalog.model_spec import ImageModelSpec
from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.app.storage import ObjectStore
from kiln.workers.device.image_stages import DeviceOptions
from kiln.workers.engines.select import EngineFactory
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.models import classify, detect, embed, phash, text_embed, vector_groups
from kiln.workers.models.base import JobClosed, Predictor

# Registered families: an ONNX file from Kiln's store, fed as its spec declares.
_REGISTERED: dict[str, Callable[..., Predictor]] = {
    "classify": classify.ClassifyPredictor,
    "embed": embed.EmbedPredictor,
    "detect": detect.YoloPredictor,
}


def load_predictor(info: ModelInfo, engines: EngineFactory) -> Predictor:
    settings, store = engines.settings, engines.store
    gpu_decode = settings.decode_on_gpu()
    options = DeviceOptions(
        settings.device_pipeline == "staged", settings.jpeg_decoder, settings.decode_threads
    )
    if info.kind == "detect" and info.builtin:
        norm = Normalization.of(detect.DetectorPredictor.preprocessing())
        engine = engines.build(info.name, detect.model_path(), engines.batch_cap, (), norm)
        return detect.DetectorPredictor(
            engine, max_pixels=settings.max_image_pixels, gpu_decode=gpu_decode,
            device_options=options,
        )  # fmt: skip
    if info.kind == "ocr":
        from kiln.workers.models import ocr  # OpenCV: imported by the one family that uses it

        return ocr.OcrPredictor(engines, max_pixels=settings.max_image_pixels)
    if info.kind == "text-embed":
        return text_embed.load_text_embed(engines, info.name)
    if info.kind == "phash":
        return phash.PhashPredictor(max_pixels=settings.max_image_pixels)
    if info.kind in _REGISTERED:
        max_batch = min(engines.batch_cap, info.spec.get("max_batch") or engines.batch_cap)
        family = _REGISTERED[info.kind]
        pre = ImageModelSpec.from_dict(info.spec).preprocessing(info.kind)
        onnx_path = fetch_onnx(info, settings, store)
        engine = engines.build(info.ref, onnx_path, max_batch, (), Normalization.of(pre))
        return family(
            info.ref, engine, info.spec, max_pixels=settings.max_image_pixels,
            gpu_decode=gpu_decode, device_options=options,
        )  # fmt: skip
    raise ValueError(f"Model {info.name!r} has kind {info.kind!r}, which this worker cannot run.")


def output_fields(info: ModelInfo) -> list[pa.Field]:
    """The Parquet columns a model family adds; known without loading the model."""
    if info.kind == "embed":
        return embed.fields(info.spec)
    if info.kind == "ocr":
        from kiln.workers.models.ocr import FIELDS

        return list(FIELDS)
    families = {
        "detect": detect.FIELDS,
        "classify": classify.FIELDS,
        "text-embed": text_embed.FIELDS,
        "phash": phash.FIELDS,
    }
    return list(families.get(info.kind, []))


def fetch_onnx(info: ModelInfo, settings: Settings, store: ObjectStore) -> Path:
    """Download a registered model once per host, verified by its sha256."""
    assert info.onnx_key and info.sha256 and settings.model_cache_dir
    path = settings.model_cache_dir / f"{info.sha256}.onnx"
    if path.is_file():
        return path
    data = store.get(info.onnx_key)
    if sha256_hex(data) != info.sha256:
        raise RuntimeError(f"The ONNX file for {info.name!r} in storage does not match its sha256.")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Its own temporary name: two loads of one model at once (two processes, or a chunk and a
    # warm-up) each write theirs, and the second atomic replace lands the same bytes. One
    # shared ".part" name let the first replace take the file from under the second.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".part", delete=False) as tmp:
        tmp.write(data)
    Path(tmp.name).replace(path)
    return path


# Families with a step when one of their jobs closes.
_JOB_CLOSED: dict[str, JobClosed] = {
    "phash": phash.close_job,
    "embed": vector_groups.close_job,
    "text-embed": vector_groups.close_job,
}


# What a pipeline's library keeps of each object besides key and sha256 (workers/models/library.py).
_LIBRARY_COLUMNS: dict[str, list[str]] = {"phash": ["phash"]}


def library_columns(info: ModelInfo) -> list[str]:
    return list(_LIBRARY_COLUMNS.get(info.kind, []))


def job_closed(info: ModelInfo) -> JobClosed | None:
    """The family's job-closed step, if it has one."""
    return _JOB_CLOSED.get(info.kind)
