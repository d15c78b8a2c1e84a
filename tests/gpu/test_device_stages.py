"""Issue 33 on a real NVIDIA GPU: the GPU JPEG decoders agree with each other and with Pillow,
and the device stages (decode → fit → forward → outputs; upload → forward →
outputs), each stage on its own CUDA stream with events between them, give the serial path's
answers with many batches in flight.

Skipped, with the reason, where no GPU or no CUDA torch is present (KILN_REQUIRE_GPU=1 makes
that an error, as in test_torch_cuda.py). On the CPU the same stages run behind stand-ins:
tests/workers/device/test_stages.py and tests/workers/device/test_image_stages.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devstack.images import photo
from tests.gpu.test_torch_cuda import MISSING, _engine, _pixels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]
MAX_PIXELS = 50_000_000


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.workers.engines.test_torch_uint8 import export

    return export(tmp_path_factory.mktemp("stages") / "classifier.onnx")


def _decoders() -> dict[str, Any]:
    from kiln.workers.device import decoders

    found = {name: decoders.jpeg_decoder(name, "cuda") for name in decoders.DECODERS}
    return {name: d for name, d in found.items() if d is not None}


def test_the_gpu_decoders_agree_with_each_other_and_with_pillow() -> None:
    import torch

    from kiln.workers.prep.pixels import decode_image

    found = _decoders()
    print(f"\nGPU JPEG decoders here: {sorted(found)}")
    if not found:
        pytest.skip("no GPU JPEG decoder works here")
    datas = [photo(s, (640, 480)) for s in range(4)] + [photo(9, (300, 500))]
    pillow = [np.asarray(decode_image(d, max_pixels=MAX_PIXELS).image) for d in datas]
    decoded = {}
    for name, decoder in found.items():
        with torch.cuda.stream(torch.cuda.Stream()):
            images = decoder.decode(datas, torch.device("cuda"))
            torch.cuda.current_stream().synchronize()
        decoded[name] = [image.permute(1, 2, 0).cpu().numpy() for image in images]
        for i, (ours, theirs) in enumerate(zip(decoded[name], pillow, strict=True)):
            assert ours.shape == theirs.shape, (name, i)
            diff = np.abs(ours.astype(int) - theirs.astype(int)).mean()
            assert diff < 2.0, f"{name} image {i}: mean |GPU - Pillow| = {diff:.2f}"
    if len(decoded) == 2:
        for a, b in zip(*decoded.values(), strict=True):
            assert np.abs(a.astype(int) - b.astype(int)).mean() < 2.0


def test_staged_decode_fit_forward_outputs_give_the_serial_answers(classifier: Path) -> None:
    """24 batches of 5 JPEGs (one of them not decodable) through the four stages from as many
    callers as the device stages hold: each batch's logits are the serial path's."""
    from devstack.images import truncated_jpeg
    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device import pixels as device_pixels
    from kiln.workers.device.image_stages import DeviceOptions, ImageStages, answer, decode_rows
    from kiln.workers.prep.header import read_header

    if not _decoders():
        pytest.skip("no GPU JPEG decoder works here")
    engine = _engine(classifier, runners=1)
    pre = Preprocessing(input_size=32)
    stages = ImageStages("t", engine, "images", pre, MAX_PIXELS, DeviceOptions())
    batches = []
    for b in range(8):
        datas = [photo(10 * b + i, (160 + 16 * i, 120)) for i in range(5)]
        if b == 3:
            datas[2] = truncated_jpeg(1)
        batches.append([(d, read_header(d, max_pixels=MAX_PIXELS)) for d in datas])

    def serial(rows: list[Any]) -> np.ndarray:
        with engine.on_stream():
            groups, failed = decode_rows(rows, engine.device, MAX_PIXELS, stages.decoder)
            fitted = device_pixels.fit_groups(groups, pre, engine.device)
            out = next(iter(engine.infer_tensors({"images": fitted.pixels}).values()))
        return answer(len(rows), out, failed, fitted.order, fitted.fits).output

    with ThreadPoolExecutor(stages.device_stages.in_flight) as callers:
        staged = list(callers.map(stages.device_stages.run, batches * 3))
    for i, (done, rows) in enumerate(zip(staged, batches * 3, strict=True)):
        np.testing.assert_allclose(done.output, serial(rows), atol=1e-3, err_msg=str(i))
    assert list(staged[3].failed) == [2] and not staged[3].output[2].any()
    assert staged[3].good == [0, 1, 3, 4]
    stats = stages.device_stages.stats()
    print(f"\nstages ({stages.decoder_name}): {stats}")
    assert all(s["batches"] == 24 for s in stats.values())
    stages.close()


def test_each_stage_calls_torch_a_few_times_a_batch_on_the_gpu(classifier: Path) -> None:
    """Issue 38 on CUDA: per stage thread, the torch calls of a batch of 640×480 JPEGs —
    `record_stream` for what is handed over among them, one per size, not one per image —
    stay the same at 16, 32 and 64 rows, and at most 16; no `torch.device` context runs
    around a stage (it would show as its own calls)."""
    import torch

    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device.image_stages import DeviceOptions, ImageStages
    from kiln.workers.device.stages import CudaStreams
    from kiln.workers.prep.header import read_header
    from tests.workers.device.counting import CountingStreams, per_batch

    if not _decoders():
        pytest.skip("no GPU JPEG decoder works here")
    engine = _engine(classifier, runners=1)
    streams = CountingStreams(CudaStreams(torch, engine.device))
    stages = ImageStages("t", engine, "images", Preprocessing(input_size=32), MAX_PIXELS,
                         DeviceOptions(), streams=streams)  # fmt: skip
    datas = [photo(i, (640, 480)) for i in range(64)]
    for rows in (16, 32, 64):
        batch = [(d, read_header(d, max_pixels=MAX_PIXELS)) for d in datas[:rows]]
        stages.device_stages.run(batch)
    stages.close()
    counted = {stage: per_batch(steps) for stage, steps in streams.steps.items()}
    print(f"\ntorch calls per batch at 16, 32, 64 ({stages.decoder_name}): {counted}")
    for stage, counts in counted.items():
        calls = counts["calls"]
        assert len(set(calls)) == 1 and calls[0] <= 16, (stage, counts)
        if stage != "decode":  # decode makes its `torch.device` for the decoder's op
            assert "call:device" not in counts, (stage, counts)  # entering one shows here
    assert counted["fit"]["call:record_stream"] == [1, 1, 1]  # the one stack of one size
    assert counted["forward"]["call:record_stream"] == [1, 1, 1]  # the fitted input


def test_staged_upload_forward_outputs_give_infers_answers(classifier: Path) -> None:
    from kiln.workers.device.image_stages import HostStages

    engine = _engine(classifier, runners=1)
    stages = HostStages("t", engine, "images")
    batches = [_pixels(rows, rows) for rows in (5, 12, 33, 1, 64, 7)]
    expected = [engine.infer({"images": b})["logits"] for b in batches]

    def run(pixels: np.ndarray) -> Any:
        buffer = engine.host_buffer(pixels.shape)  # as a worker gathers: the caller's staging
        buffer[:] = pixels
        return stages.device_stages.run(buffer)

    with ThreadPoolExecutor(stages.device_stages.in_flight) as callers:
        for _ in range(3):
            for ours, theirs in zip(callers.map(run, batches), expected, strict=True):
                np.testing.assert_allclose(ours, theirs, atol=1e-3)
    stages.close()


def test_a_graph_set_the_staged_forward_lent_back_is_safe_for_the_next_borrower(
    classifier: Path,
) -> None:
    """One graph set (runners=1), borrowed in turn by the staged forward — which lends it back
    before its replay has run — and by callers of `infer` on streams of their own: each
    borrower's stream waits for the set's last queued use (`GraphSet.released`), so every
    answer is its batch's."""
    from kiln.workers.device.image_stages import HostStages

    engine = _engine(classifier, runners=1)
    stages = HostStages("t", engine, "images")
    batches = [_pixels(rows, rows) for rows in (5, 12, 33, 64)]
    expected = [engine.infer({"images": b})["logits"] for b in batches]

    def staged(pixels: np.ndarray) -> Any:
        buffer = engine.host_buffer(pixels.shape)
        buffer[:] = pixels
        return stages.device_stages.run(buffer)

    def direct(pixels: np.ndarray) -> Any:
        return engine.infer({"images": pixels})["logits"]

    with ThreadPoolExecutor(stages.device_stages.in_flight + 4) as callers:
        runs = [(callers.submit(staged if i % 3 else direct, b), j)
                for i in range(12) for j, b in enumerate(batches)]  # fmt: skip
        for future, j in runs:
            np.testing.assert_allclose(future.result(), expected[j], atol=1e-3, err_msg=str(j))
    stages.close()
