"""SHA-256 as lowercase hex: the one way Kiln names content (API keys, model files, cache keys,
TensorRT plans). Text is hashed as its UTF-8 bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 1 << 20  # read files a MiB at a time: ONNX files and plans can be gigabytes


def sha256_hex(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
