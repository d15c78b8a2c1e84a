"""The image predictor's device path end to end, on torch CPU: the built-in detector with images
decoded, letterboxed and normalised by `device_pixels`, run by the torch engine, its candidates
made there (`detect.YoloCandidates`), matches the CPU path (Pillow + ONNX Runtime), and an
image that fails to decode fails its own item.

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
from kiln.workers.models.detect import ANCHOR, SCORE, DetectorPredictor, model_path
from tests.support import run_torch_child
from tests.workers.models.halves import batch_of, outputs, prepare

MAX_PIXELS = 50_000_000
# PNGs (no JPEG draft on the CPU path): the two sides resample within a couple of levels, so
# the raw outputs (box centres and sizes in model pixels, class scores) stay close.
IMAGES = {"wide": photo(1, (640, 480), "PNG"), "tall": photo(2, (300, 500), "PNG")}
BAD = {"truncated": truncated_jpeg(3)}  # its header reads; its pixels do not
ATOL = 1.0  # measured 2026-11-24: boxes 0.54 and 0.011 model pixels, scores 3e-4 and 2e-5

CHILD = """  # noqa: E501
import json, sys
from pathlib import Path
import numpy as np
import torch
from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.torch_engine import build_torch_engine
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.models import image_model
from kiln.workers.models.base import Batch
from kiln.workers.models.detect import DetectorPredictor, model_path
from kiln.workers.device.image_stages import DeviceOptions
from kiln.workers.models.direct import run_direct
from kiln.workers.prep.spec import build

folder = Path(sys.argv[1])
image_model.device_decoding = lambda *_: torch.device("cpu")  # a GPU decoder needs CUDA
norm = Normalization.of(DetectorPredictor.preprocessing())  # as the loader builds it
engine = build_torch_engine(EngineRequest("detector", model_path(), 8, (), norm), "cpu", 1)
predictor = DetectorPredictor(engine, max_pixels=50_000_000)
assert predictor.device is not None
assert predictor.prep.layout is None  # prep checks headers; the bytes travel as objects
names = json.loads((folder / "names.json").read_text())
datas = [(folder / f"{n}.img").read_bytes() for n in names]
# As a worker: the prep half (a prep process) gives each row (bytes, header) and a meta row;
# the batch half decodes, fits and runs them together, recording each fit in the batch's meta.
prep = build(predictor.prep)
objects, metas = [], []
for data in datas:
    meta = np.zeros(predictor.prep.meta_width, dtype=np.float32)
    objects.append(prep.prepare(data, None, meta))
    metas.append(meta)
batch = Batch(None, np.stack(metas), objects)
raws, failed = predictor._output(batch)
report = {}
for i, (name, outcome) in enumerate(zip(names, run_direct(predictor, datas))):
    np.save(folder / f"{name}.posted.npy", np.asarray(raws[i]))
    if isinstance(outcome, dict):
        report[name] = {"detections": outcome["detections"], "fit": batch.meta[i].tolist()}
    else:
        report[name] = {"error": type(outcome).__name__ + ": " + str(outcome),
                        "failed": type(failed[i]).__name__ + ": " + str(failed[i])}
# The same batch one step after another (KILN_DEVICE_PIPELINE=serial) gives the same outputs.
serial = DetectorPredictor(
    engine, max_pixels=50_000_000, device_options=DeviceOptions(staged=False)
)
again, _ = serial._output(Batch(None, np.stack(metas), objects))
report["_ways"] = {"staged": predictor.stages is not None, "serial": serial.stages is None,
                   "same": bool(np.array_equal(raws, again)), "posted": predictor.posted}
predictor.close()
(folder / "report.json").write_text(json.dumps(report))
"""


@pytest.fixture(scope="module")
def device_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("device-predictor")
    for name, data in {**IMAGES, **BAD}.items():
        (folder / f"{name}.img").write_bytes(data)
    (folder / "names.json").write_text(json.dumps([*IMAGES, *BAD]))
    run_torch_child(CHILD, folder)
    return folder


def test_the_device_path_matches_the_cpu_path(device_run: Path) -> None:
    cpu = DetectorPredictor(OnnxRuntimeEngine(model_path(), max_batch=8), max_pixels=MAX_PIXELS)
    rows = [prepare(cpu, data) for data in IMAGES.values()]
    raws, failed = cpu._output(batch_of(rows))
    assert not failed
    expected = outputs(cpu, list(IMAGES.values()))
    report = json.loads((device_run / "report.json").read_text())
    assert report["_ways"] == {"staged": True, "serial": True, "same": True, "posted": True}
    for name, row, raw, answer in zip(IMAGES, rows, raws, expected, strict=True):
        # the device's candidates (its best-scored anchors): the CPU's box and best score there
        posted = np.load(device_run / f"{name}.posted.npy")
        anchors = posted[ANCHOR].astype(np.int64)
        worst = max(float(np.abs(posted[:4] - raw[:4, anchors]).max()),
                    float(np.abs(posted[SCORE] - raw[4:, anchors].max(axis=0)).max()))  # fmt: skip
        assert worst <= ATOL, f"{name}: max |device - cpu| = {worst}"
        assert report[name]["fit"] == row.meta.tolist()  # the same placement, so boxes map
        found = report[name]["detections"]
        assert [d["label"] for d in found] == [d["label"] for d in answer["detections"]]


def test_an_image_that_fails_to_decode_fails_alone(device_run: Path) -> None:
    report = json.loads((device_run / "report.json").read_text())
    assert report["truncated"]["error"].startswith("InputError: ")
    assert report["truncated"]["failed"] == report["truncated"]["error"]  # its own row's
    assert all("detections" in report[name] for name in IMAGES)
    cpu = DetectorPredictor(OnnxRuntimeEngine(model_path(), max_batch=8), max_pixels=MAX_PIXELS)
    with pytest.raises(InputError) as raised:
        prepare(cpu, BAD["truncated"])
    assert report["truncated"]["error"] == f"InputError: {raised.value}"  # the CPU's sentence
