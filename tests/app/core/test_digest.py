"""SHA-256 hex: text is its UTF-8 bytes, files are read in blocks, both match hashlib."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kiln.app.core.digest import file_sha256, sha256_hex


def test_digest_of_text_and_bytes_agree() -> None:
    assert sha256_hex("héllo") == sha256_hex("héllo".encode())
    assert sha256_hex(b"") == hashlib.sha256(b"").hexdigest()
    assert len(sha256_hex(b"")) == 64


def test_file_sha256(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"x" * 3_000_000)  # more than one read block
    assert file_sha256(path) == hashlib.sha256(b"x" * 3_000_000).hexdigest()
