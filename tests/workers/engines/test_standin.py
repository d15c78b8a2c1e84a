"""The device stand-in (`engines/standin.py`): its calibration, its decoder and engine (timing
roughly honoured, shapes, the locks) in a child process (this one stays torch-free, as a
worker does), and `kiln run` through `ImageStages` end to end with it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from PIL import Image

from devstack.services import kiln_command
from kiln.app.core.config import Settings
from kiln.workers.engines import standin
from kiln.workers.engines.select import EngineFactory
from tests.models import colour_classifier
from tests.support import loads_no_torch, run_torch_child

H200 = standin.CALIBRATIONS["h200"]


def _jpeg(size: tuple[int, int], **save: Any) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (120, 30, 200)).save(buffer, "JPEG", **save)
    return buffer.getvalue()


def test_forward_follows_the_h200_table() -> None:
    assert H200.forward_s(32) == pytest.approx(2.81e-3)
    assert H200.forward_s(48) == pytest.approx((2.81e-3 + 5.59e-3) / 2)  # linear between
    assert H200.forward_s(512) == pytest.approx(2 * 21.6e-3)  # proportional beyond
    assert H200.forward_s(8) == pytest.approx(1.84e-3 / 2)
    assert H200.decode_s(32) == pytest.approx(0.2e-3 + 32 * 47e-6)


def test_jpeg_size_reads_the_frame_header() -> None:
    assert standin.jpeg_size(_jpeg((640, 480))) == (480, 640)
    assert standin.jpeg_size(_jpeg((33, 17), progressive=True)) == (17, 33)
    exif = Image.Exif()
    exif[0x0112] = 6  # an orientation segment before the frame: skipped by its length
    assert standin.jpeg_size(_jpeg((50, 20), exif=exif.tobytes())) == (20, 50)
    assert standin.jpeg_size(b"\xff\xd8" + b"\0" * 40) is None


def test_the_engine_factory_chooses_the_standin(tmp_path: Path) -> None:
    settings = Settings(device_standin="h200", data_dir=tmp_path)
    factory = EngineFactory(settings, store=None)  # type: ignore[arg-type]
    assert [c.backend for c in factory.candidates] == ["standin"]
    assert factory.choice.on_gpu and factory.host.gpus[0].name == H200.gpu
    assert factory.batch_cap == settings.batch_cap(on_gpu=True)


CHILD = """
import sys
from tests.workers.engines.test_standin import run_torch
run_torch(sys.argv[1])
"""


def run_torch(where: str) -> None:
    import threading
    import time

    import torch

    from kiln.workers.engines.base import EngineRequest

    folder = Path(where)
    colour_classifier(folder / "colours.onnx")
    engine = standin.build(EngineRequest("c", folder / "colours.onnx", 64), "h200", None)
    datas = [_jpeg((64, 48))] * 30 + [_jpeg((40, 40))] * 2
    started = time.perf_counter()
    images = engine.jpeg_decoder.decode(datas, engine.device)
    one = time.perf_counter() - started
    # the headers' sizes given (as `decode_groups` gives them): no byte read for them
    given = engine.jpeg_decoder.decode([b"?", b"?"], engine.device, [(10, 20), (30, 40)])
    # two threads at once: the process-wide lock makes them take turns
    spans: list[tuple[float, float]] = []
    barrier = threading.Barrier(2)

    def decode() -> None:
        barrier.wait()
        began = time.perf_counter()
        engine.jpeg_decoder.decode(datas, engine.device)
        spans.append((began, time.perf_counter()))

    threads = [threading.Thread(target=decode) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pixels = torch.empty((32, 32, 32, 3), dtype=torch.uint8, device=engine.device)
    queued = time.perf_counter()
    first = engine.forward_tensors({"images": pixels})
    second = engine.forward_tensors({"images": pixels})  # the device runs one after the other
    launch = time.perf_counter() - queued
    host = engine.outputs_to_host(second, 32)
    waited = time.perf_counter() - queued
    report = {
        "shapes": sorted({tuple(i.shape) for i in images}),
        "given": [list(i.shape) for i in given],
        "devices": sorted({str(i.device) for i in images}),
        "dtype": str(images[0].dtype),
        "one_s": one,
        "both_s": max(e for _b, e in spans) - min(b for b, _e in spans),
        "launch_s": launch,
        "waited_s": waited,
        "outputs": {k: [list(v.shape), str(v.dtype), float(abs(v).sum())] for k, v in host.items()},
        "first": [list(t.shape) for t in first],
        "busy": engine.probe.busy.seconds,
        "inputs": [list(s.shape) for s in engine.inputs],
        "backend": engine.backend,
        "threads": torch.get_num_threads(),
    }
    (folder / "report.json").write_text(json.dumps(report))


def test_decoder_and_engine_honour_the_calibration(tmp_path: Path) -> None:
    run_torch_child(CHILD, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["shapes"] == [[3, 40, 40], [3, 48, 64]] and report["devices"] == ["meta"]
    assert report["given"] == [[3, 10, 20], [3, 30, 40]]
    assert report["dtype"] == "torch.uint8"
    decode = H200.decode_s(32)
    assert decode * 0.9 <= report["one_s"] < decode + 0.05
    assert report["both_s"] >= 2 * decode * 0.9  # one lock: the second waited for the first
    forward = H200.forward_s(32)
    assert report["launch_s"] < forward  # queued, as a CUDA launch: nothing waited for
    assert 2 * forward * 0.9 <= report["waited_s"] < 2 * forward + 0.05
    assert report["outputs"] == {"logits": [[32, 4], "float32", 0.0]}  # zeros: never a result
    assert report["first"] == [[32, 4]]
    assert report["busy"]["forward"] == pytest.approx(2 * forward)
    assert report["busy"]["decode"] >= 3 * decode * 0.9
    assert report["inputs"] == [[None, 32, 32, 3]]
    assert report["backend"] == "standin:h200" and report["threads"] == 1


def test_kiln_run_goes_through_the_device_stages(tmp_path: Path) -> None:
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(6):
        (photos / f"p{i}.jpg").write_bytes(_jpeg((64 + 8 * i, 48)))
    report, output = tmp_path / "standin.json", tmp_path / "out.parquet"
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("KILN_")}
    env = {**clean, "KILN_DATA_DIR": str(tmp_path / "data"), "KILN_DEVICE_STANDIN": "h200",
           "KILN_DEVICE_STANDIN_REPORT": str(report)}  # fmt: skip
    command = kiln_command("run", str(photos), "--model", "detector", "-o", str(output))
    with loads_no_torch():
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    statuses = pq.read_table(output).column("status").to_pylist()
    assert statuses == ["succeeded"] * 6
    found = json.loads(report.read_text())
    assert found["rows"]["decode"] == found["rows"]["forward"] == 6  # every image, on the device
    # the detector's candidates picked on the device, charged there; the copy back is theirs
    assert found["rows"]["post"] == 6 and found["batches"]["post"] == found["batches"]["forward"]
    assert found["busy_s"]["post"] == pytest.approx(standin.POST_S * found["batches"]["post"])
    assert pq.read_table(output).column("detections").to_pylist() == [[]] * 6  # zeros: none
    [stages] = found["pipelines"]
    assert stages["name"] == "detector-device"
    assert stages["stats"]["fit"]["batches"] >= 1
    stages = {s["thread"].rsplit("-", 2)[1] for s in found["stages"]}
    assert stages == {"decode", "fit", "forward", "outputs"}
    assert found["peak_threads"] > 0 and any(t["cpu_s"] > 0 for t in found["threads"])


def test_a_thread_ending_keeps_its_name_in_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread that has left Python's thread list but not yet /proc (its last read, at exit)
    keeps the name it had, so its CPU stays in its group (a chunk thread's went to 'native:')."""
    probe = standin.Probe(standin.calibration("h200"), None)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="kiln-chunk-test")
    thread.start()
    try:
        probe.read_threads()
        monkeypatch.setattr(threading, "enumerate", lambda: [threading.main_thread()])
        probe.read_threads()
        assert probe._cpu[thread.native_id][0] == "kiln-chunk-test"  # type: ignore[index]
    finally:
        stop.set()
        thread.join()
