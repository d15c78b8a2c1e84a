"""What a model's load measured, kept so the next load on the same model, backend and device
does not measure it again.

A GPU load sweeps batch sizes for `KILN_MAX_BATCH=auto` (`batch_size.choose_batch`, seconds of
engine calls). A second `kiln run` (or a restarted worker) on the same model version, backend
and device would find the same answer, so `Learned` keeps each answer in a small JSON file under
the model cache (`KILN_MODEL_CACHE_DIR`, `.kiln/models` by default): `learned/<what>/<digest>.json`,
named by a digest of its key and holding the key itself. Any change to the key — the model's
weights or version, the backend, the device or its driver, the batch cap, the rule's own
source — names another file, so the answer is measured again. A file that does not parse, or
whose key disagrees, is ignored with a log line (and written over by the new answer); a write
that fails is logged: the cache only saves time, it never stops a load.

The same store remembers a model file's sha256 by the file's identity (`known_sha256`): a GPU
load names the file's uint8 rewrite by it (`onnx_uint8.prepended_path`), and hashing a large
model on every start measured again what nothing had changed. A converted torch module is not
kept: onnx2fx's graphs call functions local to its converters, which nothing can serialize
(`torch_engine`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.app.core.digest import file_sha256, sha256_hex

if TYPE_CHECKING:
    from kiln.workers.ops.device import Gpu

log = logging.getLogger(__name__)

FOLDER = "learned"
Value = int | float | str | bool


@dataclass(frozen=True)
class LearnedKey:
    """What an answer depends on; equal keys share one answer."""

    what: str  # the measurement, e.g. "max_batch"
    model: str  # the model's version and weights (`ModelInfo.ref` and `cache_key`)
    backend: str  # `Engine.backend`, e.g. `tensorrt` or `torch:cuda:fp16`
    device: str  # `device_key`: the GPU and its driver, or `cpu`
    extra: Mapping[str, Value] = field(default_factory=dict)  # the rule's own inputs

    def fields(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "extra": dict(sorted(self.extra.items())),
        }

    @property
    def digest(self) -> str:
        return sha256_hex(json.dumps(self.fields(), sort_keys=True, separators=(",", ":")))


class Learned:
    """Answers kept under `folder` (None: nothing kept, every answer measured)."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder / FOLDER if folder is not None else None

    def path(self, key: LearnedKey) -> Path | None:
        safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in key.what)
        return self.folder / safe / f"{key.digest[:32]}.json" if self.folder else None

    def get(self, key: LearnedKey) -> Value | None:
        """The kept answer for `key`, or None (a miss, or an entry that cannot be trusted)."""
        path = self.path(key)
        if path is None:
            return None
        try:
            entry = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("ignoring the learned %s at %s: unreadable (%s)", key.what, path, error)
            return None
        if not isinstance(entry, dict) or entry.get("key") != key.fields():
            log.warning("ignoring the learned %s at %s: its key does not match", key.what, path)
            return None
        value = entry.get("value")
        if not isinstance(value, Value):
            log.warning("ignoring the learned %s at %s: no usable value", key.what, path)
            return None
        return value

    def put(self, key: LearnedKey, value: Value) -> None:
        """Keep `value` for `key`, written whole (a reader never sees half a file)."""
        path = self.path(key)
        if path is None:
            return
        text = json.dumps({"key": key.fields(), "value": value}, indent=2)
        partial = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(text)
            partial.replace(path)
        except OSError as error:
            log.warning("could not keep the learned %s at %s: %s", key.what, path, error)
            with contextlib.suppress(OSError):
                partial.unlink()

    def remember(
        self,
        key: LearnedKey,
        measure: Callable[[], Value],
        valid: Callable[[Value], bool] = lambda _v: True,
    ) -> Value:
        """The kept answer for `key` (when `valid`), else `measure()` — kept for next time."""
        kept = self.get(key)
        if kept is not None and not valid(kept):
            log.warning("ignoring the learned %s for %s: %r is not a usable answer", key.what,
                        key.model, kept)  # fmt: skip
            kept = None
        if kept is not None:
            log.info("%s for %s on %s: %s, as measured before", key.what, key.model, key.device,
                     kept)  # fmt: skip
            return kept
        value = measure()
        self.put(key, value)
        return value


def device_key(gpu: Gpu | None) -> str:
    """The device an answer was measured on: the GPU's model and compute capability and the
    driver (a new driver may change the timings), or `cpu`."""
    if gpu is None:
        return "cpu"
    return f"{gpu.slug}-driver{driver_version()}"


def known_sha256(path: Path, learned: Learned) -> str:
    """`file_sha256(path)`, hashed once per version of the file: remembered by its identity
    (device, inode, size, modification time in ns), as git's index and make trust them. A GPU
    load names its uint8 rewrite by the model file's sha256; this spares reading the whole
    model again on every start."""
    stat = path.stat()
    identity = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino,
                "device": stat.st_dev}  # fmt: skip
    key = LearnedKey("sha256", str(path.resolve()), "-", "-", identity)
    digest = learned.remember(
        key, lambda: file_sha256(path), valid=lambda v: isinstance(v, str) and len(v) == 64
    )
    return str(digest)


@cache
def driver_version() -> str:
    """The NVIDIA driver's version, as NVML says (`unknown` without NVML)."""
    from kiln.workers.ops.device import nvml

    lib = nvml()
    if lib is None:
        return "unknown"
    try:
        version = lib.nvmlSystemGetDriverVersion()
    except lib.NVMLError:
        return "unknown"
    return version.decode() if isinstance(version, bytes) else str(version)


@cache
def source_digest(path: str) -> str:
    """A short digest of a rule's source file: a changed rule measures again."""
    return file_sha256(Path(path))[:16]
