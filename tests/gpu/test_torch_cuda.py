"""The PyTorch CUDA engine driven the GPU's way, on a real NVIDIA GPU: uint8 pixels through
pinned staging buffers, normalised on the device; FP16 weights; CUDA graphs per batch bucket
(padded batches, two runners at once) against the eager path and ONNX Runtime on the CPU;
nvJPEG decoding with the batched fit; the nvJPEG op loaded without importing torchvision; and
the first answer soon after the engine is ready.

Skipped, with the reason, where no GPU or no CUDA torch is present; with KILN_REQUIRE_GPU=1 a
missing piece is an error. The same logic runs on the CPU in tests/workers/engines/
test_torch_uint8.py (graphs behind an eager stand-in).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from devstack.images import photo
from kiln.workers.engines.base import EngineRequest
from kiln.workers.engines.cuda_graphs import buckets
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.engines.uint8_input import Normalization
from kiln.workers.ops.device import list_gpus

REQUIRED = os.environ.get("KILN_REQUIRE_GPU") == "1"


def _missing() -> str | None:
    if not list_gpus():
        return "no NVIDIA GPU visible (NVML)"
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnx2fx") is None:
        return "torch or onnx2fx is not installed"
    import torch

    return None if torch.cuda.is_available() else "torch does not see CUDA"


MISSING = _missing()
if MISSING and REQUIRED:
    raise RuntimeError(f"KILN_REQUIRE_GPU=1, but {MISSING}.")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]

NORM = Normalization(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
ATOL_FP16 = 5e-2  # logits of the small classifier, FP16 weights against FP32 on the CPU


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.workers.engines.test_torch_uint8 import export

    return export(tmp_path_factory.mktemp("cuda") / "classifier.onnx")


def _engine(path: Path, max_batch: int = 64, graphs: bool = True, runners: int = 2) -> Any:
    from kiln.workers.engines.torch_engine import build_torch_engine

    request = EngineRequest("c", path, max_batch, normalization=NORM)
    return build_torch_engine(request, "cuda", runners, graphs=graphs)


def _pixels(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8)


def test_uint8_graphs_and_fp16_match_the_cpu(classifier: Path) -> None:
    """Batches of 1, 3, 16 and 33 (buckets 1, 4, 16, 64: padded) replayed from graphs give
    ONNX Runtime's logits over NumPy's normalisation, within FP16's error, and the eager
    path's within rounding; the graphs were all captured while the engine was built."""
    engine = _engine(classifier)
    assert engine.backend == "torch:cuda:fp16" and engine.options.half_weights
    assert engine.inputs[0].dtype == "uint8" and engine.graphs is not None
    eager = _engine(classifier, graphs=False)
    reference = OnnxRuntimeEngine(classifier, max_batch=64)
    for seed, rows in enumerate((1, 3, 16, 33, 3)):
        pixels = _pixels(rows, seed)
        ours = engine.infer({"images": pixels})["logits"]
        theirs = reference.infer({"images": pixels}, {"images": NORM})["logits"]
        np.testing.assert_allclose(ours, theirs, atol=ATOL_FP16, err_msg=str(rows))
        plain = eager.infer({"images": pixels})["logits"]
        np.testing.assert_allclose(ours, plain, atol=1e-2, err_msg=str(rows))
    # captured at load: every bucket up to 64, once per runner (two), none since
    assert engine.graphs.captured() == {bucket: 2 for bucket in buckets(64)}
    engine.close()
    assert engine.graphs is None


def test_staging_buffers_are_pinned_and_a_gathered_batch_is_read_in_place(
    classifier: Path,
) -> None:
    import torch

    engine = _engine(classifier)
    buffer = engine.host_buffer((8, 32, 32, 3))
    assert torch.from_numpy(buffer).is_pinned()
    buffer[:] = _pixels(8)
    from_buffer = engine.infer({"images": buffer})["logits"]
    np.testing.assert_array_equal(from_buffer, engine.infer({"images": _pixels(8)})["logits"])
    staging = engine._transfers.staging()
    assert all(b.is_pinned() for b in staging._buffers.values())


def test_two_runners_replay_their_own_graphs_at_once(classifier: Path) -> None:
    engine = _engine(classifier, runners=2)
    batches = [_pixels(rows, rows) for rows in (5, 12, 5, 12, 7, 30)]
    expected = [engine.infer({"images": b})["logits"] for b in batches]
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            found = list(pool.map(lambda b: engine.infer({"images": b})["logits"], batches))
            for ours, theirs in zip(found, expected, strict=True):
                np.testing.assert_array_equal(ours, theirs)


def test_nvjpeg_and_the_batched_fit_on_the_gpu() -> None:
    """JPEGs of two sizes decoded by nvJPEG and fitted a size group at a time equal each image
    fitted alone on the GPU, and stay near Pillow's fit on the CPU."""
    import torch

    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device import pixels as di
    from kiln.workers.prep.pixels import decode_image, fit_image

    if not di.nvjpeg_available("cuda"):
        pytest.skip("torchvision's nvJPEG decoder is not available here")
    datas = [photo(s, (640, 480)) for s in range(3)] + [photo(9, (300, 500))]
    images = di.by_row(*di.decode_groups(datas, "cuda", max_pixels=50_000_000), len(datas))
    pre = Preprocessing(224)
    batch, _metas = di.fit_batch(images, pre)
    alone = torch.stack([di.fit_on_device(image, pre)[0] for image in images])
    assert batch.device.type == "cuda" and batch.dtype == torch.uint8
    assert torch.equal(batch, alone.to(torch.uint8).permute(0, 2, 3, 1))
    for i, data in enumerate(datas):
        cpu, _ = fit_image(decode_image(data, max_pixels=50_000_000), pre)
        diff = np.abs(batch[i].cpu().numpy().astype(int) - cpu.astype(int))
        assert diff.mean() < 3.0, i  # nvJPEG decodes whole, Pillow drafts: measured ≤ 2.3


def test_the_nvjpeg_op_loads_without_torchvision() -> None:
    """A fresh process probes nvJPEG without importing the torchvision package (seconds, and
    torch._dynamo with sympy, on the way to a worker's first answer)."""
    script = (
        "import sys, time; import torch; t = time.perf_counter()\n"
        "from kiln.workers.device.pixels import nvjpeg_available\n"
        "ok = nvjpeg_available('cuda')\n"
        "print(ok, round(time.perf_counter() - t, 2), 'torchvision' in sys.modules,"
        " 'torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, check=True, cwd=Path(__file__).parents[2])  # fmt: skip
    ok, seconds, torchvision, dynamo, sympy = result.stdout.split()
    print(f"\nnvJPEG probe: available {ok} in {seconds} s; torchvision {torchvision}, "
          f"dynamo {dynamo}, sympy {sympy}")  # fmt: skip
    if ok != "True":
        pytest.skip("torchvision's nvJPEG decoder is not available here")
    assert torchvision == "False" and dynamo == "False" and sympy == "False"


def test_the_first_answer_comes_soon_after_the_engine_is_ready(tmp_path: Path) -> None:
    """The built-in detector on torch-cuda as the loader builds it (uint8, graphs): its first
    image answered within 5 s of the engine being ready."""
    from kiln.app.core.config import Settings
    from kiln.app.storage.local import LocalStore
    from kiln.workers.engines.select import EngineFactory
    from kiln.workers.models.detect import DetectorPredictor, model_path
    from kiln.workers.models.direct import run_direct

    settings = Settings(data_dir=tmp_path, engine="torch-cuda")
    factory = EngineFactory(settings, LocalStore(tmp_path / "store"))
    norm = Normalization.of(DetectorPredictor.preprocessing())
    engine = factory.build("detector", model_path(), 64, (), norm)
    predictor = DetectorPredictor(engine, max_pixels=50_000_000)
    started = time.perf_counter()
    (answer,) = run_direct(predictor, [photo(1, (640, 480))])
    seconds = time.perf_counter() - started
    print(f"\nfirst answer {seconds:.2f} s after the engine was ready ({engine.reason})")
    assert isinstance(answer, dict) and seconds < 5.0
