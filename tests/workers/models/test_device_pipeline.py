"""The image pipeline's device path end to end, on torch CPU: the built-in detector with images
decoded, letterboxed and normalised by `device_images` and run by the torch engine matches the
CPU path (Pillow + ONNX Runtime), and an image that fails to decode fails its own item.

nvJPEG needs CUDA, so the child process turns device decoding on for the CPU device (the same
torch code, with Pillow as the decoder); torch runs in that child so this process stays as
torch-free as a worker.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from devstack.images import photo, truncated_jpeg
from kiln.app.core.errors import InputError
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.detect import DetectorPipeline, model_path
from tests.support import run_torch_child

MAX_PIXELS = 50_000_000
# PNGs (no JPEG draft on the CPU path): the two sides resample within a couple of levels, so
# the raw outputs (box centres and sizes in model pixels, class scores) stay close.
IMAGES = {"wide": photo(1, (640, 480), "PNG"), "tall": photo(2, (300, 500), "PNG")}
BAD = {"truncated": truncated_jpeg(3)}  # its header reads; its pixels do not
ATOL = 1.0  # measured 2026-11-24: boxes 0.54 and 0.011 model pixels, scores 3e-4 and 2e-5

CHILD = """
import json, sys
from pathlib import Path
import numpy as np
import torch
from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.torch_engine import build_torch_engine
from kiln.workers.models import image_model
from kiln.workers.models.detect import DetectorPipeline, model_path

folder = Path(sys.argv[1])
image_model.device_decoding = lambda engine, pre: torch.device("cpu")  # nvJPEG needs CUDA
engine = build_torch_engine(EngineRequest("detector", model_path(), 8), "cpu", 1)
pipeline = DetectorPipeline(engine, max_pixels=50_000_000)
assert pipeline.device is not None
names = json.loads((folder / "names.json").read_text())
rows = [pipeline.prepare((folder / f"{n}.img").read_bytes()) for n in names]
raws = pipeline.infer(rows)
report = {}
for name, row, raw in zip(names, rows, raws):
    np.save(folder / f"{name}.raw.npy", np.asarray(raw))
    try:
        report[name] = {"detections": pipeline.finish(row, raw)["detections"],
                        "fit": repr(row.meta.get("fit"))}
    except Exception as error:
        report[name] = {"error": type(error).__name__ + ": " + str(error)}
(folder / "report.json").write_text(json.dumps(report))
"""


@pytest.fixture(scope="module")
def device_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("device-pipeline")
    for name, data in {**IMAGES, **BAD}.items():
        (folder / f"{name}.img").write_bytes(data)
    (folder / "names.json").write_text(json.dumps([*IMAGES, *BAD]))
    run_torch_child(CHILD, folder)
    return folder


def test_the_device_path_matches_the_cpu_path(device_run: Path) -> None:
    cpu = DetectorPipeline(OnnxRuntimeEngine(model_path(), max_batch=8), max_pixels=MAX_PIXELS)
    rows = [cpu.prepare(data) for data in IMAGES.values()]
    report = json.loads((device_run / "report.json").read_text())
    for name, row, raw in zip(IMAGES, rows, cpu.infer(rows), strict=True):
        ours = np.load(device_run / f"{name}.raw.npy")
        worst = float(np.abs(ours - raw).max())
        assert worst <= ATOL, f"{name}: max |device - cpu| = {worst}"
        assert report[name]["fit"] == repr(row.meta["fit"])  # the same placement, so boxes map
        expected = cpu.finish(row, raw)["detections"]
        assert [d["label"] for d in report[name]["detections"]] == [d["label"] for d in expected]


def test_an_image_that_fails_to_decode_fails_alone(device_run: Path) -> None:
    report = json.loads((device_run / "report.json").read_text())
    assert report["truncated"]["error"].startswith("InputError: ")
    assert all("detections" in report[name] for name in IMAGES)
    cpu = DetectorPipeline(OnnxRuntimeEngine(model_path(), max_batch=8), max_pixels=MAX_PIXELS)
    with pytest.raises(InputError) as raised:
        cpu.prepare(BAD["truncated"])
    assert report["truncated"]["error"] == f"InputError: {raised.value}"  # the CPU's sentence
