"""TensorRT plans and timing caches in object storage, so a new worker downloads, not builds;
and the `PlanSpec` (profile, precision, key) a plan is built from.

A plan is only valid for the ONNX file, TensorRT version, GPU model, precision and profile it
was built with, so all five make its key. Beside each plan a small JSON manifest records that key
and the plan's sha256: a plan whose manifest disagrees, whose bytes do not match, or which does
not deserialize is rebuilt (and logged), never a crash. Nothing here imports TensorRT.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from kiln.app.core.digest import file_sha256, sha256_hex
from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.tensorrt_logic import (
    EngineBuildError,
    Precision,
    PrecisionSetting,
    TensorRange,
    batch_profile,
    decide_precision,
    onnx_input_shapes,
)

if TYPE_CHECKING:
    from kiln.app.storage import ObjectStore
    from kiln.workers.ops.device import Gpu

log = logging.getLogger(__name__)

PREFIX = "engines/tensorrt"
MISSING = "no cached plan"
FORCED = "rebuild forced"
T = TypeVar("T")


def key_part(text: str) -> str:
    """`text` made safe as one storage-key segment (versions like `10.13.0.35` stay readable)."""
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in text).strip(".") or "-"


@dataclass(frozen=True)
class EngineKey:
    """What a serialized plan depends on; equal keys may share one plan."""

    onnx_sha256: str
    tensorrt_version: str
    gpu: str  # `Gpu.slug`: name and compute capability
    precision: str
    profile: tuple[TensorRange, ...]

    def fields(self) -> dict[str, Any]:
        """The key as plain JSON values (what the manifest records)."""
        return {
            "onnx_sha256": self.onnx_sha256,
            "tensorrt_version": self.tensorrt_version,
            "gpu": self.gpu,
            "precision": self.precision,
            "profile": [
                {"name": r.name, "min": list(r.min), "opt": list(r.opt), "max": list(r.max)}
                for r in self.profile
            ],
        }

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return sha256_hex(canonical)

    @property
    def plan_key(self) -> str:
        """`engines/tensorrt/<gpu>/trt<version>/<precision>/<onnx sha256>-<digest16>.plan`:
        readable parts to list or prune by GPU and version, the digest covering the profile."""
        folder = timing_folder(self.tensorrt_version, self.gpu)
        name = f"{key_part(self.onnx_sha256)}-{self.digest[:16]}"
        return f"{folder}/{key_part(self.precision)}/{name}.plan"

    @property
    def manifest_key(self) -> str:
        return self.plan_key.removesuffix(".plan") + ".json"


def timing_folder(tensorrt_version: str, gpu: str) -> str:
    return f"{PREFIX}/{key_part(gpu)}/trt{key_part(tensorrt_version)}"


def timing_cache_key(tensorrt_version: str, gpu: str) -> str:
    """One timing cache per GPU model and TensorRT version, shared by every model's builds
    (layer timings carry over between models; a cache from another GPU would mislead)."""
    return f"{timing_folder(tensorrt_version, gpu)}/timing.cache"


# --- what a plan is built from ------------------------------------------------------------


@dataclass(frozen=True)
class PlanSpec:
    """Everything a plan is built from, and the cache key that names it."""

    model: str
    onnx_path: Path
    profile: tuple[TensorRange, ...]
    precision: Precision
    key: EngineKey


def plan_spec(
    request: EngineRequest,
    gpu: Gpu,
    precision: PrecisionSetting,
    *,
    tensorrt_version: str,
    fast_fp16: Callable[[], bool],
) -> PlanSpec:
    """The profile from the ONNX file's shapes, the precision, and the key naming the plan.
    `fast_fp16` is only asked for `auto` (it creates a TensorRT builder)."""
    path = Path(request.onnx_path)
    profile = batch_profile(onnx_input_shapes(path), request.max_batch, request.axes)
    chosen = decide_precision(precision, precision == "auto" and fast_fp16())
    key = EngineKey(file_sha256(path), tensorrt_version, gpu.slug, chosen, profile)
    return PlanSpec(request.name, path, profile, chosen, key)


# --- plans --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanRead:
    plan: bytes | None
    why: str  # "cached", or why the cached plan cannot be used


def read_plan(store: ObjectStore, key: EngineKey) -> PlanRead:
    """The stored plan for `key` if its manifest matches the key and its bytes the checksum."""
    try:
        if not store.exists(key.manifest_key) or not store.exists(key.plan_key):
            return PlanRead(None, MISSING)
        manifest = json.loads(store.get(key.manifest_key))
        plan = store.get(key.plan_key)
    except Exception as error:  # the cache is an optimisation: a store fault means "build"
        return PlanRead(None, f"cache unreadable ({error})")
    if not isinstance(manifest, dict) or manifest.get("key") != key.fields():
        return PlanRead(None, "manifest does not match the key")
    if manifest.get("plan_sha256") != sha256_hex(plan):
        return PlanRead(None, "plan bytes do not match the manifest's checksum")
    return PlanRead(plan, "cached")


def write_plan(store: ObjectStore, key: EngineKey, plan: bytes, model: str) -> None:
    """Plan first, manifest second: a reader that sees the manifest finds the plan it names
    (a concurrent writer at worst makes the checksum disagree, which means a rebuild)."""
    manifest = {
        "key": key.fields(),
        "plan_sha256": sha256_hex(plan),
        "plan_bytes": len(plan),
        "model": model,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        store.put(key.plan_key, plan, "application/octet-stream")
        store.put(key.manifest_key, json.dumps(manifest, indent=2).encode(), "application/json")
    except Exception as error:  # the engine works without the cache; the next worker rebuilds
        log.warning("could not store the TensorRT plan at %s: %s", key.plan_key, error)


@dataclass(frozen=True)
class Obtained(Generic[T]):
    value: T
    source: Literal["cache", "built"]
    why: str  # for "built": why the cache could not serve


def load_or_build(
    store: ObjectStore,
    key: EngineKey,
    *,
    build: Callable[[], bytes],
    load: Callable[[bytes], T | None],
    model: str = "",
    force: bool = False,
) -> Obtained[T]:
    """Load the cached plan; on a miss, a mismatch or a plan that `load` refuses (returns None
    or raises), build one, store it and load that. Only a fresh plan that fails to load raises."""
    read = PlanRead(None, FORCED) if force else read_plan(store, key)
    if read.plan is not None:
        loaded = _try_load(load, read.plan)
        if loaded is not None:
            log.info("TensorRT plan for %s loaded from %s", model, key.plan_key)
            return Obtained(loaded, "cache", "cached")
        read = PlanRead(None, "cached plan does not deserialize")
    # A plan that was there but unusable is worth a warning; a plain miss is not.
    level = logging.INFO if read.why in (MISSING, FORCED) else logging.WARNING
    log.log(level, "building the TensorRT plan for %s: %s", model, read.why)
    started = time.perf_counter()
    plan = build()
    log.info("TensorRT plan for %s built in %.1f s", model, time.perf_counter() - started)
    write_plan(store, key, plan, model)
    fresh = _try_load(load, plan)
    if fresh is None:
        raise EngineBuildError(f"The TensorRT plan just built for {model} does not deserialize.")
    return Obtained(fresh, "built", read.why)


def _try_load(load: Callable[[bytes], T | None], plan: bytes) -> T | None:
    try:
        return load(plan)
    except Exception as error:  # a stale or corrupt plan is rebuilt, never fatal
        log.warning("TensorRT plan does not deserialize: %s", error)
        return None


# --- timing cache -------------------------------------------------------------------------


def read_timing_cache(store: ObjectStore, key: str) -> bytes:
    """The stored timing cache, or b"" (TensorRT's "start an empty one")."""
    try:
        return store.get(key) if store.exists(key) else b""
    except Exception as error:  # only slows the build down
        log.warning("could not read the TensorRT timing cache %s: %s", key, error)
        return b""


def write_timing_cache(store: ObjectStore, key: str, data: bytes) -> None:
    """Last writer wins: two workers building at once may each lose the other's new timings,
    which only costs a later build some time."""
    try:
        store.put(key, data, "application/octet-stream")
    except Exception as error:
        log.warning("could not store the TensorRT timing cache %s: %s", key, error)
