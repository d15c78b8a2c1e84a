"""A registered model's ONNX file is fetched once per host, whoever asks first."""

from __future__ import annotations

import threading
from pathlib import Path

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.app.core.digest import sha256_hex
from kiln.workers.models.loader import fetch_onnx


class Store:
    """Hands out the model's bytes, slowly enough that every caller is past the cache check."""

    def __init__(self, data: bytes, callers: int) -> None:
        self.data = data
        self.barrier = threading.Barrier(callers)

    def get(self, key: str) -> bytes:
        self.barrier.wait(timeout=10)
        return self.data


def test_loads_of_one_model_at_once_all_get_the_file(tmp_path: Path) -> None:
    data = b"onnx bytes " * 10_000
    info = ModelInfo(
        name="m", kind="embed", input="image", description="", builtin=False, version="1",
        onnx_key="models/m.onnx", sha256=sha256_hex(data),
    )  # fmt: skip
    settings = Settings(data_dir=tmp_path)
    store = Store(data, callers=8)
    got: list[Path | BaseException] = []

    def load() -> None:
        try:
            got.append(fetch_onnx(info, settings, store))  # type: ignore[arg-type]
        except BaseException as error:
            got.append(error)

    threads = [threading.Thread(target=load) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(isinstance(path, Path) for path in got), got
    [path] = set(got)
    assert isinstance(path, Path) and path.read_bytes() == data
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
