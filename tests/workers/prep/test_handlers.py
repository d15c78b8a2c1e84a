"""The handlers' shortcuts: each gives what the long way gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kiln.app.core.config import get_settings
from kiln.app.core.digest import sha256_hex
from kiln.app.video import HEAD_BYTES, container_of
from kiln.app.video.container import _MP4_BOXES
from kiln.workers.prep import handlers
from kiln.workers.prep.handlers import _plain_jpeg, is_video
from kiln.workers.prep.process import PrepWorker
from kiln.workers.prep.settings import PrepSettings
from kiln.workers.prep.spec import prep_spec
from kiln.workers.prep.units import Unit

TEXTS = prep_spec("tests.workers.prep.stand_ins:TextPrep", {})


def _heads() -> list[bytes]:
    """JPEG starts, and near misses, with what `container_of` looks for at 4:8 planted."""
    rng = random.Random(38)

    def noise(n: int) -> bytes:
        return bytes(rng.randrange(256) for _ in range(n))

    heads = [b"", b"\xff", b"\xff\xd8\xff", b"\xff\xd8\xff\xe0", b"\xff\xd8\xff\xe0\x47"]
    for box in [*_MP4_BOXES, b"ftyp", b"moov", b"JFIF", b"Exif", b"\x00\x10JF", b"G\x00\x00\x00"]:
        for size in (0, 1, 8, 24, 4096, 0xFFD8FFE0):
            heads.append(size.to_bytes(4, "big") + box + noise(600))
            heads.append(b"\xff\xd8\xff\xe1" + box + noise(600))
    for _ in range(3000):  # a JPEG's start, the rest at random; now and then TS sync bytes
        head = bytearray(b"\xff\xd8\xff" + noise(rng.choice((5, 400, 1100))))
        if rng.random() < 0.3:
            for i in range(4, len(head), 192):
                head[i] = 0x47
        heads.append(bytes(head))
    return heads


def test_a_plain_jpeg_is_told_from_a_video_as_container_of_tells_it() -> None:
    for head in _heads():
        if _plain_jpeg(head):
            assert container_of(head[:HEAD_BYTES]) is None, head[:12]
        assert is_video(head) == (container_of(head[:HEAD_BYTES]) is not None), head[:12]


def test_the_prepare_after_a_read_only_unit_reuses_its_bytes_and_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Content cache on: the read-only unit reads and hashes each file once; its prepare
    takes the bytes and the hash it kept, and looks for no video in them again."""
    paths = [tmp_path / f"{i}.txt" for i in range(3)]
    for i, path in enumerate(paths):
        path.write_text(f"text {i}")
    sources: list[str | None] = [p.as_uri() for p in paths]
    unit = Unit(0, TEXTS, [1, 2, 3], sources, [None] * 3, 1000)
    read_only = Unit(0, TEXTS, [1, 2, 3], sources, [None] * 3, 1000, read_only=True)
    settings = get_settings(data_dir=tmp_path / "data", local_inputs=True)
    worker = PrepWorker(PrepSettings.of(settings))
    calls = {"hash": 0, "video": 0}
    looked = handlers.is_video

    def counted_hash(data: bytes | str) -> str:
        calls["hash"] += 1
        return sha256_hex(data)

    def counted_video(data: bytes) -> bool:
        calls["video"] += 1
        return looked(data)

    monkeypatch.setattr(handlers, "sha256_hex", counted_hash)
    monkeypatch.setattr(handlers, "is_video", counted_video)
    read = worker.run(read_only)
    assert calls == {"hash": 3, "video": 3}
    for path in paths:
        path.unlink()  # the prepare reads nothing: it has the bytes
    answer = worker.run(unit)
    assert calls == {"hash": 3, "video": 3}
    assert answer.errors == [None] * 3 and answer.objects == ["TEXT 0", "TEXT 1", "TEXT 2"]
    assert answer.sha256 == read.sha256 == [sha256_hex(f"text {i}".encode()) for i in range(3)]
    worker.close()
