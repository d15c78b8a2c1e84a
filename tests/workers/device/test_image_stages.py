"""An image model's four device stages (`device/image_stages.py`) on torch's CPU, in a child
process (this one stays torch-free, as a worker does): Pillow stands in for the GPU decoder
and a stand-in engine for the forward pass. The staged answer is the serial one, image for
image, with many batches in flight from many callers; an image that does not decode gets a row
of zeros and its error; a batch none of whose images decode fails whole. On a GPU the same
stages run on CUDA streams (tests/gpu, bench.gpu)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.support import run_torch_child

CHILD = """
import sys
from tests.workers.device.test_image_stages import run_torch
run_torch(sys.argv[1])
"""
MAX_PIXELS = 50_000_000


class StandInEngine:
    """The forward pass as a mean per image (its input is what the fit stage made), and the
    copy back as `.numpy()`."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def forward_tensors(self, tensors: dict[str, Any]) -> list[Any]:
        pixels = tensors["images"]
        return [pixels.float().mean(dim=(1, 2)).reshape(len(pixels), 3)]

    def outputs_to_host(self, values: list[Any], rows: int) -> dict[str, np.ndarray]:
        return {"out": values[0][:rows].numpy().copy()}


def run_torch(where: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from devstack.images import photo, truncated_jpeg
    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device import pixels as device_pixels
    from kiln.workers.device.image_stages import DeviceOptions, ImageStages
    from kiln.workers.prep.header import read_header

    pre = Preprocessing(input_size=64, fit="letterbox")
    engine = StandInEngine()
    stages = ImageStages("test", engine, "images", pre, MAX_PIXELS, DeviceOptions())  # type: ignore[arg-type]
    batches = []
    for b in range(8):
        datas = [photo(10 * b + i, (64 + 16 * i, 48 + 8 * b)) for i in range(5)]
        if b == 2:
            datas[1] = truncated_jpeg(3)  # its header reads; Pillow refuses its pixels
        batches.append([(d, read_header(d, max_pixels=MAX_PIXELS)) for d in datas])

    def serial(rows: list[Any]) -> np.ndarray:
        """Image by image: each decoded, fitted alone, then the batch run at once."""
        datas = [d for d, _h in rows]
        decoded = device_pixels.decode_groups(datas, engine.device, max_pixels=MAX_PIXELS)
        images = device_pixels.by_row(*decoded, len(datas))
        good = [i for i, image in enumerate(images) if not isinstance(image, Exception)]
        alone = [device_pixels.fit_on_device(images[i], pre)[0] for i in good]
        pixels = torch.stack(alone).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
        out = engine.outputs_to_host(engine.forward_tensors({"images": pixels}), len(good))
        full = np.zeros((len(rows), 3), dtype=np.float32)
        full[good] = out["out"]
        return full

    with ThreadPoolExecutor(stages.device_stages.in_flight) as callers:
        staged = list(callers.map(stages.device_stages.run, batches * 3))
    report: dict[str, Any] = {
        "same": [bool(np.array_equal(a.output, serial(rows)))
                 for a, rows in zip(staged, batches * 3, strict=True)],
        "failed": {str(k): str(v) for k, v in staged[2].failed.items()},
        "zero_row": staged[2].output[1].tolist(),
        "good": staged[2].good,
        "fits": [[rows.tolist(), sorted(meta)] for rows, meta in staged[0].fits],
        "decoder": stages.decoder_name,
        "stats": stages.device_stages.stats(),
    }  # fmt: skip
    bad = [(truncated_jpeg(4), read_header(truncated_jpeg(4), max_pixels=MAX_PIXELS))] * 2
    try:
        stages.device_stages.run(bad)
        report["all_bad"] = "ran"
    except Exception as error:
        report["all_bad"] = f"{type(error).__name__}: {error}"
    stages.close()
    (Path(where) / "report.json").write_text(json.dumps(report))


def test_staged_answers_are_the_serial_ones(tmp_path: Path) -> None:
    run_torch_child(CHILD, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["decoder"] == "pillow"  # no GPU decoder on the CPU
    assert all(report["same"]) and len(report["same"]) == 24
    assert list(report["failed"]) == ["1"] and "image" in report["failed"]["1"].lower()
    assert report["zero_row"] == [0.0, 0.0, 0.0]
    assert report["good"] == [0, 2, 3, 4]
    # letterbox: each size group's placement, as the CPU path records it (5 sizes: 5 groups)
    assert report["fits"] == [[[i], ["fit"]] for i in range(5)]
    assert report["all_bad"] == "InputError: No image of the batch decoded."
    stats = report["stats"]
    assert stats["decode"]["batches"] == stats["outputs"]["batches"] == 24
