"""What a load measured, kept for the next load: a hit, a miss on each change of the key, an
entry that cannot be trusted ignored with a log line, and the batch choice reusing it."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kiln.app.catalog.catalog import ModelInfo
from kiln.app.core.config import Settings
from kiln.workers.engines.learned import Learned, LearnedKey, device_key
from kiln.workers.ops.device import Gpu
from kiln.workers.runners import sizing

KEY = LearnedKey("max_batch", "resnet:3@image:abc", "tensorrt", "nvidia-h200-sm90-driver570",
                 {"cap": 256, "rule": "r1"})  # fmt: skip
H200 = Gpu(0, "NVIDIA H200", "GPU-1", (9, 0), 141 * 2**30)


class Counted:
    """A measurement that says how often it ran."""

    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


def test_a_second_load_reuses_the_answer(tmp_path: Path) -> None:
    measure = Counted(64)
    assert Learned(tmp_path).remember(KEY, measure) == 64
    assert Learned(tmp_path).remember(KEY, measure) == 64  # a new process: read from disk
    assert measure.calls == 1
    assert Learned(tmp_path).get(KEY) == 64


@pytest.mark.parametrize(
    "changed",
    [
        replace(KEY, model="resnet:4@image:def"),  # another version or weights
        replace(KEY, backend="torch:cuda:fp16"),
        replace(KEY, device="nvidia-h100-sm90-driver570"),
        replace(KEY, device="nvidia-h200-sm90-driver575"),  # the same GPU, a new driver
        replace(KEY, device="cpu"),
        replace(KEY, extra={"cap": 128, "rule": "r1"}),
        replace(KEY, extra={"cap": 256, "rule": "r2"}),  # the rule changed
        replace(KEY, what="fp16_ok"),
    ],
)
def test_any_change_of_the_key_measures_again(tmp_path: Path, changed: LearnedKey) -> None:
    Learned(tmp_path).put(KEY, 64)
    measure = Counted(32)
    assert Learned(tmp_path).remember(changed, measure) == 32
    assert measure.calls == 1
    assert Learned(tmp_path).get(KEY) == 64  # the other key's answer stays


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"{not json", "unreadable"),
        (b'{"key": {"what": "max_batch"}, "value": 64}', "its key does not match"),
        (b'["a list"]', "its key does not match"),
        (None, "no usable value"),  # the right key, but no value
    ],
)
def test_an_entry_that_cannot_be_trusted_is_ignored_with_a_log_line(
    tmp_path: Path, content: bytes | None, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    learned = Learned(tmp_path)
    learned.put(KEY, 64)
    path = learned.path(KEY)
    assert path is not None and path.exists()
    if content is None:
        path.write_text(path.read_text().replace('"value": 64', '"value": null'))
    else:
        path.write_bytes(content)
    measure = Counted(16)
    with caplog.at_level(logging.WARNING, logger="kiln.workers.engines.learned"):
        assert learned.remember(KEY, measure) == 16
    assert measure.calls == 1
    assert any(said in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
    assert learned.get(KEY) == 16  # written over by the new answer


def test_an_answer_that_fails_its_check_is_measured_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    Learned(tmp_path).put(KEY, 4096)
    with caplog.at_level(logging.WARNING, logger="kiln.workers.engines.learned"):
        kept = Learned(tmp_path).remember(KEY, Counted(64), valid=lambda v: v == 64)
    assert kept == 64
    assert "4096 is not a usable answer" in caplog.text


def test_no_folder_keeps_nothing(tmp_path: Path) -> None:
    measure = Counted(64)
    Learned(None).remember(KEY, measure)
    Learned(None).remember(KEY, measure)
    assert measure.calls == 2


def test_a_folder_that_cannot_be_written_only_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="kiln.workers.engines.learned"):
        assert Learned(blocker).remember(KEY, Counted(64)) == 64
    assert "could not keep the learned max_batch" in caplog.text


def test_the_device_key_names_the_gpu_and_its_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.workers.engines import learned

    monkeypatch.setattr(learned, "driver_version", lambda: "570.86")
    assert device_key(H200) == "nvidia-h200-sm90-driver570.86"
    assert device_key(None) == "cpu"


# --- the batch choice -----------------------------------------------------------------------


def model(version: str = "1", sha: str = "aa") -> ModelInfo:
    return ModelInfo("resnet", "classify", "image", "", False, version, sha256=sha)


def load(gpu: Gpu = H200) -> Any:
    """What `learned_batch` reads of an engine factory: the host's GPUs."""
    return SimpleNamespace(host=SimpleNamespace(gpus=(gpu,)))


@pytest.fixture
def sweeps(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The sweeps run (the real one times an engine for seconds): the knee is cap ÷ 4."""
    ran: list[tuple[str, int]] = []

    def choose(engine: Any, cap: int, name: str = "", **options: Any) -> int:
        ran.append((engine.backend, cap))
        return cap // 4

    monkeypatch.setattr(sizing, "choose_batch", choose)
    monkeypatch.setattr("kiln.workers.engines.learned.driver_version", lambda: "570")
    return ran


def test_the_batch_is_swept_once_per_model_backend_device_and_cap(
    tmp_path: Path, sweeps: list[tuple[str, int]]
) -> None:
    settings = Settings.model_validate({"data_dir": tmp_path})
    trt = SimpleNamespace(backend="tensorrt")
    assert sizing.learned_batch(settings, model(), trt, 256, load()) == 64
    assert sizing.learned_batch(settings, model(), trt, 256, load()) == 64
    assert sweeps == [("tensorrt", 256)]  # the second load read it
    h100 = replace(H200, name="NVIDIA H100")
    sizing.learned_batch(settings, model(), trt, 256, load(h100))  # another device
    sizing.learned_batch(settings, model(version="2", sha="bb"), trt, 256, load())  # new weights
    sizing.learned_batch(settings, model(), SimpleNamespace(backend="torch:cuda"), 256, load())
    sizing.learned_batch(settings, model(), trt, 128, load())  # another cap
    sizing.learned_batch(settings, model(), trt, 256, load(), staged=True)  # another rule input
    sizing.learned_batch(settings, model(), trt, 256, load(), staged=True)
    assert len(sweeps) == 6
    assert settings.model_cache_dir == tmp_path.resolve() / "models"  # under the data dir
    assert len(list((settings.model_cache_dir / "learned" / "max_batch").iterdir())) == 6


def test_a_kept_batch_above_the_cap_is_swept_again(
    tmp_path: Path, sweeps: list[tuple[str, int]]
) -> None:
    settings = Settings.model_validate({"data_dir": tmp_path})
    trt = SimpleNamespace(backend="tensorrt")
    sizing.learned_batch(settings, model(), trt, 256, load())
    assert settings.model_cache_dir is not None
    for path in (settings.model_cache_dir / "learned" / "max_batch").iterdir():
        path.write_text(path.read_text().replace('"value": 64', '"value": 512'))
    assert sizing.learned_batch(settings, model(), trt, 256, load()) == 64
    assert len(sweeps) == 2


def test_a_file_is_hashed_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.app.core.digest import file_sha256
    from kiln.workers.engines import learned

    hashed: list[Path] = []

    def counting(path: Path) -> str:
        hashed.append(path)
        return file_sha256(path)

    monkeypatch.setattr(learned, "file_sha256", counting)
    model_file, cache = tmp_path / "model.onnx", Learned(tmp_path / "cache")
    model_file.write_bytes(b"weights v1")
    first = learned.known_sha256(model_file, cache)
    assert learned.known_sha256(model_file, Learned(tmp_path / "cache")) == first
    assert len(hashed) == 1  # the second start read it back
    model_file.write_bytes(b"weights, v2")  # a new version: its size and time change
    assert learned.known_sha256(model_file, cache) == file_sha256(model_file) != first
    assert len(hashed) == 2
