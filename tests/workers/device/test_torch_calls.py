"""The torch calls each stage of an image model's device stages makes per batch (issue 38):
every torch call releases the GIL, and in the engine's process, where ~40 other threads hold it
most of the time, each release costs a quarter of a millisecond. So a stage's calls, and the
tensors the device stages hands over between streams (`record_stream` on a GPU, one call each), are
counted here per stage thread with a `TorchFunctionMode`, at batches of 16, 32 and 64: they
stay the same whatever the batch's length, and at most 16. Attribute reads (`.shape`) go
through the mode too but do not release the GIL: counted apart, and flat as well.

torch runs in a child process (this one stays torch-free, as a worker does), on the CPU: the
stages with Pillow decoding (the CPU's route), and with a stand-in for torchvision's batched
nvJPEG op (one torch call for the batch, as the real one; it decodes with Pillow) that routes
JPEGs as a GPU does. Both give the same answers; an EXIF-turned JPEG adds its own call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import run_torch_child

CHILD = """
import sys
from tests.workers.device.test_torch_calls import run_torch
run_torch(sys.argv[1])
"""
MAX_PIXELS = 50_000_000
SIZES = (16, 32, 64)
MOST = 16  # torch calls a stage may make per batch (issue 38's target)


def standin_op(calls: list[int]) -> Any:
    """torchvision's batched nvJPEG op as one torch call (as the real op is one binding): the
    JPEGs decoded by Pillow, orientation as stored (nvJPEG leaves EXIF be)."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    def decode_jpegs(encoded: list[Any], device: Any) -> list[Any]:
        calls.append(len(encoded))
        images = [np.array(Image.open(io.BytesIO(t.numpy().tobytes())).convert("RGB"))
                  for t in encoded]  # fmt: skip
        return [torch.from_numpy(i).permute(2, 0, 1).to(device) for i in images]

    counted = torch.overrides.wrap_torch_function(lambda encoded, device: encoded)(decode_jpegs)
    return counted


class Engine:
    """The forward pass as a mean per image, the copy back as `.numpy()`."""

    def __init__(self) -> None:
        import torch

        self.device = torch.device("cpu")

    def forward_tensors(self, tensors: dict[str, Any]) -> list[Any]:
        return [tensors["images"].float().mean(dim=(1, 2))]

    def outputs_to_host(self, values: list[Any], rows: int) -> dict[str, Any]:
        return {"out": values[0][:rows].numpy().copy()}


def turned(data: bytes) -> bytes:
    """The JPEG stored on its side with EXIF orientation 6 (upright it is taller than wide)."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(data)).transpose(Image.Transpose.ROTATE_90)
    exif = image.getexif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif.tobytes())
    return buffer.getvalue()


def run_torch(where: str) -> None:
    import numpy as np
    import torch

    from devstack.images import photo
    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device.decoders import TorchvisionJpeg
    from kiln.workers.device.image_stages import DeviceOptions, ImageStages
    from kiln.workers.prep.header import read_header
    from tests.workers.device.counting import CountingStreams, per_batch

    torch.set_num_threads(1)  # a tiny op must not open an OpenMP region
    pre = Preprocessing(input_size=32)
    sizes = {"one size": [(64, 48)], "two sizes": [(64, 48), (48, 64)]}
    report: dict[str, Any] = {}
    answers: dict[str, list[Any]] = {}
    op_calls: list[int] = []
    for route in ("pillow", "nvjpeg"):
        for label, shapes in sizes.items():
            streams = CountingStreams()
            decoder = TorchvisionJpeg(standin_op(op_calls)) if route == "nvjpeg" else None
            stages = ImageStages("t", Engine(), "images", pre, MAX_PIXELS, DeviceOptions(),  # type: ignore[arg-type]
                                 decoder=decoder, streams=streams)  # fmt: skip
            for rows in SIZES:
                datas = [photo(i, shapes[i % len(shapes)]) for i in range(rows)]
                batch = [(d, read_header(d, max_pixels=MAX_PIXELS)) for d in datas]
                answers.setdefault(f"{label} {rows}", []).append(
                    stages.device_stages.run(batch).output
                )
            stages.close()
            report[f"{route}, {label}"] = {
                stage: per_batch(steps) for stage, steps in streams.steps.items()
            }
    # EXIF: two of 16 JPEGs stored turned; the decoder leaves them so, one call each turns them
    streams, decoder = CountingStreams(), TorchvisionJpeg(standin_op(op_calls))
    stages = ImageStages("t", Engine(), "images", pre, MAX_PIXELS, DeviceOptions(),  # type: ignore[arg-type]
                         decoder=decoder, streams=streams)  # fmt: skip
    datas = [photo(i, (64, 48)) for i in range(16)]
    datas[3], datas[9] = turned(datas[3]), turned(datas[9])
    batch = [(d, read_header(d, max_pixels=MAX_PIXELS)) for d in datas]
    turned_answer = stages.device_stages.run(batch)
    stages.close()
    report["exif"] = {stage: per_batch(steps) for stage, steps in streams.steps.items()}
    report["views"] = rows_as_views(pre, TorchvisionJpeg(standin_op(op_calls)))
    report["exif_fits"] = [rows.tolist() for rows, _meta in turned_answer.fits]
    report["same"] = {key: bool(np.array_equal(*found)) for key, found in answers.items()}
    report["op_calls"] = op_calls
    (Path(where) / "report.json").write_text(json.dumps(report))


def rows_as_views(pre: Any, decoder: Any) -> dict[str, bool]:
    """Rows whose bytes are views of one shared buffer (as prep's shared memory hands them):
    each route's answers are the bytes' own."""
    import numpy as np

    from devstack.images import photo
    from kiln.workers.device.image_stages import DeviceOptions, ImageStages
    from kiln.workers.prep.header import read_header

    datas = [photo(i, (64, 48) if i % 3 else (48, 64)) for i in range(16)]
    shared, views, offset = memoryview(bytearray().join(datas)), [], 0
    for data in datas:
        views.append(shared[offset : offset + len(data)])
        offset += len(data)
    same = {}
    for route, chosen in (("pillow", None), ("nvjpeg", decoder)):
        stages = ImageStages("t", Engine(), "images", pre, MAX_PIXELS, DeviceOptions(),  # type: ignore[arg-type]
                             decoder=chosen)  # fmt: skip
        answers = [
            stages.device_stages.run([(d, read_header(d, max_pixels=MAX_PIXELS)) for d in rows])
            for rows in (datas, views)
        ]
        stages.close()
        same[route] = bool(np.array_equal(answers[0].output, answers[1].output))
    return same


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("torch-calls")
    run_torch_child(CHILD, folder)
    found: dict[str, Any] = json.loads((folder / "report.json").read_text())
    for case in ("pillow, one size", "nvjpeg, one size", "nvjpeg, two sizes"):
        for stage, counts in found[case].items():
            print(f"\n{case} {stage} at {SIZES}: calls {counts.get('calls')}, "
                  f"handed {counts.get('handed')}, getters {counts.get('getters')}")  # fmt: skip
    return found


@pytest.mark.parametrize("case", ["pillow, one size", "pillow, two sizes", "nvjpeg, one size",
                                  "nvjpeg, two sizes"])  # fmt: skip
def test_each_stage_calls_torch_a_few_times_a_batch_whatever_its_length(
    report: dict[str, Any], case: str
) -> None:
    stages = report[case]
    assert set(stages) == {"decode", "fit", "forward", "outputs"}
    for stage, counts in stages.items():
        calls, handed = counts["calls"], counts.get("handed", [0] * len(SIZES))
        assert len(calls) == len(SIZES), (stage, counts)
        assert len(set(calls)) == 1, f"{case}: {stage}'s calls grow with the batch: {calls}"
        assert len(set(handed)) == 1, f"{case}: {stage} is handed more with the batch: {handed}"
        assert len(set(counts.get("getters", [0]))) == 1, (case, stage, counts)
        if case.endswith("one size"):
            assert calls[0] + handed[0] <= MOST, f"{case}: {stage} {calls[0]} + {handed[0]}"


def test_the_hand_over_is_one_tensor_a_size_not_one_an_image(report: dict[str, Any]) -> None:
    for sizes, label in ((1, "one size"), (2, "two sizes")):
        fit = report[f"nvjpeg, {label}"]["fit"]
        assert fit["handed"] == [sizes] * len(SIZES)  # the decode stage's stacks
        assert report[f"nvjpeg, {label}"]["forward"]["handed"] == [1] * len(SIZES)  # the input


def test_the_decoder_takes_the_batch_in_one_call(report: dict[str, Any]) -> None:
    decode = report["nvjpeg, one size"]["decode"]
    assert decode["call:decode_jpegs"] == [1] * len(SIZES)
    assert decode["call:split"] == [1] * len(SIZES)  # the batch's bytes: one tensor, one split
    assert report["op_calls"][: 2 * len(SIZES)] == [*SIZES, *SIZES]  # no image tried alone


def test_an_exif_turned_jpeg_adds_its_own_call(report: dict[str, Any]) -> None:
    upright = report["nvjpeg, one size"]["decode"]["calls"][0]
    assert report["exif"]["decode"]["calls"] == [upright + 2]  # two turned: rot90 each
    # stored on their sides, upright the turned two are the others' size: one group
    assert report["exif_fits"] == [list(range(16))]


def test_rows_may_be_views_of_shared_memory(report: dict[str, Any]) -> None:
    assert report["views"] == {"pillow": True, "nvjpeg": True}


def test_the_routes_give_the_same_answers(report: dict[str, Any]) -> None:
    """Pillow on the host and the stand-in nvJPEG (then grouped, stacked, fitted alike)."""
    assert report["same"] and all(report["same"].values()), report["same"]
