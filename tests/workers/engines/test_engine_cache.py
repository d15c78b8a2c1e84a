"""The TensorRT plan cache on a real `LocalStore`, with fakes standing in for TensorRT's build
and deserialize steps: keys, the read/rebuild decision, and the timing cache."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.app.storage.base import check_key
from kiln.app.storage.local import LocalStore
from kiln.workers.engines.engine_cache import (
    FORCED,
    MISSING,
    EngineKey,
    key_part,
    load_or_build,
    read_plan,
    read_timing_cache,
    timing_cache_key,
    write_plan,
    write_timing_cache,
)
from kiln.workers.engines.tensorrt_logic import EngineBuildError, TensorRange

PROFILE = (TensorRange("images", (1, 3, 224, 224), (16, 3, 224, 224), (16, 3, 224, 224)),)
KEY = EngineKey("ab" * 32, "10.13.0.35", "nvidia-a10g-sm86", "fp16", PROFILE)


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "objects")


class FakeBuilder:
    """Stands in for `build_plan`: counts builds and returns a recognisable plan."""

    def __init__(self, plan: bytes = b"PLAN:v1") -> None:
        self.plan = plan
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.plan


def deserialize(plan: bytes) -> str | None:
    """Stands in for `runtime.deserialize_cuda_engine`: None for bytes it does not know."""
    return plan.decode() if plan.startswith(b"PLAN:") else None


def never_build() -> bytes:
    raise AssertionError("the cached plan should have been used")


# --- keys ---------------------------------------------------------------------------------


def test_key_is_stable_and_readable() -> None:
    again = EngineKey("ab" * 32, "10.13.0.35", "nvidia-a10g-sm86", "fp16", PROFILE)
    assert again.plan_key == KEY.plan_key
    # Pinned: changing the key's format orphans every stored plan, so do it on purpose.
    assert KEY.plan_key == (
        f"engines/tensorrt/nvidia-a10g-sm86/trt10.13.0.35/fp16/{'ab' * 32}-{KEY.digest[:16]}.plan"
    )
    assert (
        KEY.digest
        == hashlib.sha256(
            json.dumps(KEY.fields(), sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    )
    assert KEY.manifest_key == KEY.plan_key.removesuffix(".plan") + ".json"
    assert check_key(KEY.plan_key) and check_key(KEY.manifest_key)


@pytest.mark.parametrize(
    "changed",
    [
        replace(KEY, onnx_sha256="cd" * 32),
        replace(KEY, tensorrt_version="10.14.0.1"),
        replace(KEY, gpu="nvidia-l4-sm89"),
        replace(KEY, gpu="nvidia-a10g-sm80"),  # same name, other compute capability
        replace(KEY, precision="fp32"),
        replace(KEY, profile=(replace(PROFILE[0], max=(32, 3, 224, 224)),)),
        replace(KEY, profile=(replace(PROFILE[0], opt=(8, 3, 224, 224)),)),
        replace(KEY, profile=(replace(PROFILE[0], name="pixels"),)),
    ],
    ids=["onnx", "tensorrt", "gpu", "compute-capability", "precision", "max", "opt", "input"],
)
def test_every_component_changes_the_key(changed: EngineKey) -> None:
    assert changed.plan_key != KEY.plan_key
    assert changed.digest != KEY.digest


def test_key_parts_are_safe_segments() -> None:
    assert key_part("10.13.0.35") == "10.13.0.35"
    assert key_part("a/b c") == "a-b-c"
    assert key_part("..") == "-"


def test_timing_cache_is_per_gpu_and_tensorrt_version_not_per_model() -> None:
    key = timing_cache_key("10.13.0.35", "nvidia-a10g-sm86")
    assert key == "engines/tensorrt/nvidia-a10g-sm86/trt10.13.0.35/timing.cache"
    assert key != timing_cache_key("10.13.0.35", "nvidia-l4-sm89")
    assert key != timing_cache_key("10.14.0.1", "nvidia-a10g-sm86")
    assert check_key(key)


# --- the read / rebuild decision ----------------------------------------------------------


def test_a_miss_builds_and_stores(store: LocalStore) -> None:
    build = FakeBuilder()
    got = load_or_build(store, KEY, build=build, load=deserialize, model="resnet")
    assert (got.value, got.source, got.why) == ("PLAN:v1", "built", MISSING)
    assert build.calls == 1
    assert store.get(KEY.plan_key) == b"PLAN:v1"
    manifest = json.loads(store.get(KEY.manifest_key))
    assert manifest["key"] == KEY.fields()
    assert manifest["plan_sha256"] == hashlib.sha256(b"PLAN:v1").hexdigest()
    assert manifest["model"] == "resnet"


def test_a_new_worker_downloads_instead_of_building(store: LocalStore) -> None:
    load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    got = load_or_build(store, KEY, build=never_build, load=deserialize)
    assert (got.value, got.source) == ("PLAN:v1", "cache")


def test_another_key_does_not_see_the_plan(store: LocalStore) -> None:
    load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    other = replace(KEY, precision="fp32")
    build = FakeBuilder(b"PLAN:fp32")
    assert load_or_build(store, other, build=build, load=deserialize).source == "built"
    assert build.calls == 1


def test_corrupted_plan_bytes_are_rebuilt(store: LocalStore, caplog) -> None:
    load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    store.put(KEY.plan_key, b"PLAN:truncat")
    caplog.set_level(logging.INFO, "kiln.workers.engines.engine_cache")
    got = load_or_build(store, KEY, build=FakeBuilder(b"PLAN:v2"), load=deserialize)
    assert (got.value, got.source) == ("PLAN:v2", "built")
    assert "checksum" in got.why
    assert any(r.levelno == logging.WARNING and "checksum" in r.message for r in caplog.records)
    assert read_plan(store, KEY).plan == b"PLAN:v2"  # healed for the next worker


def test_a_manifest_for_another_key_is_rebuilt(store: LocalStore) -> None:
    load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    manifest = json.loads(store.get(KEY.manifest_key))
    manifest["key"]["tensorrt_version"] = "10.0.0.6"
    store.put(KEY.manifest_key, json.dumps(manifest).encode())
    got = load_or_build(store, KEY, build=FakeBuilder(b"PLAN:v2"), load=deserialize)
    assert (got.source, got.why) == ("built", "manifest does not match the key")


def test_a_plan_without_manifest_is_not_trusted(store: LocalStore) -> None:
    store.put(KEY.plan_key, b"PLAN:orphan")
    got = load_or_build(store, KEY, build=FakeBuilder(b"PLAN:v2"), load=deserialize)
    assert (got.value, got.why) == ("PLAN:v2", MISSING)


def test_a_plan_that_does_not_deserialize_is_rebuilt(store: LocalStore, caplog) -> None:
    # Checksum and manifest fine, but TensorRT refuses the bytes (e.g. built by another
    # TensorRT patch, or a driver change): deserialize returns None.
    write_plan(store, KEY, b"JUNK", "resnet")
    caplog.set_level(logging.INFO, "kiln.workers.engines.engine_cache")
    got = load_or_build(store, KEY, build=FakeBuilder(), load=deserialize, model="resnet")
    assert (got.value, got.source, got.why) == (
        "PLAN:v1",
        "built",
        "cached plan does not deserialize",
    )
    assert any("does not deserialize" in r.message for r in caplog.records)
    assert store.get(KEY.plan_key) == b"PLAN:v1"


def test_a_deserializer_that_raises_means_rebuild(store: LocalStore) -> None:
    write_plan(store, KEY, b"PLAN:old", "m")
    calls = []

    def load(plan: bytes) -> str:
        calls.append(plan)
        if plan == b"PLAN:old":
            raise RuntimeError("engine plan version mismatch")
        return plan.decode()

    got = load_or_build(store, KEY, build=FakeBuilder(), load=load)
    assert (got.value, got.source) == ("PLAN:v1", "built")
    assert calls == [b"PLAN:old", b"PLAN:v1"]


def test_a_fresh_plan_that_does_not_load_is_an_error(store: LocalStore) -> None:
    with pytest.raises(EngineBuildError, match="just built for resnet does not deserialize"):
        load_or_build(store, KEY, build=FakeBuilder(b"JUNK"), load=deserialize, model="resnet")


def test_a_build_failure_propagates_and_stores_nothing(store: LocalStore) -> None:
    def failing() -> bytes:
        raise EngineBuildError("TensorRT could not parse m.onnx: No importer for op: Foo.")

    with pytest.raises(EngineBuildError, match="Foo"):
        load_or_build(store, KEY, build=failing, load=deserialize)
    assert not store.exists(KEY.plan_key)
    assert not store.exists(KEY.manifest_key)


def test_force_rebuilds_a_valid_plan(store: LocalStore) -> None:
    load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    build = FakeBuilder(b"PLAN:v2")
    got = load_or_build(store, KEY, build=build, load=deserialize, force=True)
    assert (got.value, got.why, build.calls) == ("PLAN:v2", FORCED, 1)


class BrokenStore(LocalStore):
    """A store whose reads or writes fail, like S3 during an outage."""

    def __init__(self, root: Path, *, reads: bool = True, writes: bool = True) -> None:
        super().__init__(root)
        self.reads, self.writes = reads, writes

    def exists(self, key: str) -> bool:
        if not self.reads:
            raise ConnectionError("store unreachable")
        return super().exists(key)

    def put(self, key: str, data: bytes, content_type: str | None = None) -> None:
        if not self.writes:
            raise ConnectionError("store unreachable")
        super().put(key, data, content_type)


def test_an_unreadable_store_means_build(tmp_path: Path) -> None:
    store = BrokenStore(tmp_path / "objects", reads=False)
    got = load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    assert got.source == "built"
    assert "unreadable" in got.why


def test_an_unwritable_store_still_gives_an_engine(tmp_path: Path, caplog) -> None:
    store = BrokenStore(tmp_path / "objects", writes=False)
    got = load_or_build(store, KEY, build=FakeBuilder(), load=deserialize)
    assert (got.value, got.source) == ("PLAN:v1", "built")
    assert any("could not store" in r.message for r in caplog.records)


# --- timing cache -------------------------------------------------------------------------


def test_timing_cache_round_trip(store: LocalStore) -> None:
    key = timing_cache_key("10.13.0.35", "nvidia-a10g-sm86")
    assert read_timing_cache(store, key) == b""  # TensorRT's "start an empty cache"
    write_timing_cache(store, key, b"timings")
    assert read_timing_cache(store, key) == b"timings"


def test_timing_cache_faults_only_cost_time(tmp_path: Path, caplog) -> None:
    store = BrokenStore(tmp_path / "objects", reads=False, writes=False)
    key = timing_cache_key("10.13.0.35", "nvidia-a10g-sm86")
    assert read_timing_cache(store, key) == b""
    write_timing_cache(store, key, b"timings")
    assert sum("timing cache" in r.message for r in caplog.records) == 2
