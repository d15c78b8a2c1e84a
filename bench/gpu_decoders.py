"""`bench.gpu`'s decoder part (issue 33): how fast each JPEG decoder Kiln can use turns the
bench's 640×480 JPEGs into pixels, and how that scales with threads — the numbers behind
`KILN_JPEG_DECODER`'s order and the CPU/GPU decode split.

Rows (each a rate over `seconds` after a warm-up, batches of 64):
- per GPU decoder (`workers/device/decoders.py`: nvImageCodec with all its backends, with the
  hardware engines only and with CUDA only; torchvision's nvJPEG) and 1, 2 and 4 threads, each
  thread on its own CUDA stream with its own decoder state: decode only, then decode + the
  device fit to ResNet-50's 224 crop (`device_pixels.fit_batch`) at the best thread count;
- the CPU, as prep processes decode: Pillow with the DCT draft and the fit, one process per
  core (`cpu decode + fit, N processes`).

    python -m bench.gpu_decoders --images 2000 --out decoders.json [--device cuda|cpu]

On the CPU (`--device cpu`, the tests) only the CPU row is measured; the GPU rows say why not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from bench.gpu_feed import Busy, images
from bench.gpu_report import Row, row, skipped

BATCH = 64
THREADS = (1, 2, 4)
# nvImageCodec's backend kinds per subject (None: all of them, hardware first)
NVIMGCODEC = {
    "nvimgcodec": None,
    "nvimgcodec, hardware only": ("HW_GPU_ONLY",),
    "nvimgcodec, CUDA only": ("GPU_ONLY",),
}


def gpu_decoders() -> dict[str, Callable[[], Any]]:
    """Subject name → a maker of that decoder (it may raise: the row then says why)."""
    import torch

    from kiln.workers.device import decoders

    makers: dict[str, Callable[[], Any]] = {}
    for name, backends in NVIMGCODEC.items():
        makers[name] = partial(_nvimgcodec, decoders, torch, backends)
    makers["torchvision"] = lambda: _torchvision(decoders)
    return makers


def _nvimgcodec(decoders: Any, torch: Any, backends: Sequence[str] | None) -> Any:
    module = decoders.nvimgcodec_module()
    if module is None:
        raise RuntimeError("nvidia-nvimgcodec is not installed (the bundle's decoder part)")
    return decoders.NvImageCodecJpeg(module, torch.cuda.current_device(), backends)


def _torchvision(decoders: Any) -> Any:
    op = decoders.torchvision_op()
    if op is None:
        raise RuntimeError("torchvision's image library is not there")
    return decoders.TorchvisionJpeg(op)


def threaded_rate(
    decoder: Any, datas: list[bytes], threads: int, seconds: float, fit: bool
) -> tuple[float, list[float]]:
    """Images/s of `threads` threads decoding batches (and fitting them with `fit`), each on
    its own stream, started together; NVML samples while they run."""
    import torch

    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.device import pixels as device_pixels

    pre = Preprocessing(input_size=224)
    device = torch.device("cuda")
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    stop = threading.Event()

    def work(index: int) -> None:
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        offset = index * BATCH
        try:
            with torch.cuda.stream(stream):
                _one(offset)  # warm: the decoder's state, the allocator
                stream.synchronize()
                start.wait()
                while not stop.is_set():
                    _one(offset)
                    counts[index] += BATCH
                    offset = (offset + BATCH * threads) % max(1, len(datas) - BATCH)
                stream.synchronize()
        except BaseException as error:
            errors.append(error)
            start.abort()

    def _one(offset: int) -> None:
        decoded = decoder.decode(datas[offset : offset + BATCH], device)
        if fit:
            device_pixels.fit_batch([d for d in decoded if d is not None], pre)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):  # a thread failed: its error below
        start.wait()
    with Busy() as busy:
        began = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for thread in workers:
            thread.join()
        elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return sum(counts) / elapsed, busy.samples


def gpu_rows(datas: list[bytes], seconds: float) -> list[Row]:
    rows: list[Row] = []
    for name, make in gpu_decoders().items():
        try:
            decoder = make()
        except Exception as error:
            rows.append(skipped("decoders", f"{name} decode", _sentence(error), "failed"))
            continue
        best, best_threads = 0.0, 1
        for threads in THREADS:
            subject = f"{name} decode, {threads} thread{'s' if threads > 1 else ''}"
            try:
                rate, samples = threaded_rate(decoder, datas, threads, seconds, fit=False)
            except Exception as error:
                traceback.print_exc()
                rows.append(skipped("decoders", subject, _sentence(error), "failed"))
                break
            rows.append(row("decoders", subject, BATCH, rate, samples))
            if rate > best:
                best, best_threads = rate, threads
        if best > 0:
            subject = f"{name} decode + fit, {best_threads} threads"
            try:
                rate, samples = threaded_rate(decoder, datas, best_threads, seconds, fit=True)
                rows.append(row("decoders", subject, BATCH, rate, samples))
            except Exception as error:
                traceback.print_exc()
                rows.append(skipped("decoders", subject, _sentence(error), "failed"))
    return rows


def _cpu_decode(paths: Sequence[Path]) -> int:
    """One prep process's work on `paths`: Kiln's decode (DCT draft) and fit to a 224 crop."""
    import numpy as np

    from kiln.app.catalog.model_spec import Preprocessing
    from kiln.workers.prep.images import ImagePrep

    prep = ImagePrep(Preprocessing(input_size=224), max_pixels=100_000_000)
    slot, meta = np.empty((224, 224, 3), np.uint8), np.empty(4, np.float32)
    for path in paths:
        prep.prepare(path.read_bytes(), slot, meta)
    return len(paths)


def cpu_row(paths: list[Path], processes: int) -> Row:
    """Every core decoding as the prep processes do, over all of `paths`."""
    parts = [paths[i::processes] for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        list(pool.map(_cpu_decode, [p[:4] for p in parts]))  # imports, first images
        began = time.perf_counter()
        done = sum(pool.map(_cpu_decode, parts))
        elapsed = time.perf_counter() - began
    return row("decoders", f"cpu decode + fit, {processes} processes", None, done / elapsed, [])


def measure(paths: list[Path], device: str, seconds: float) -> list[Row]:
    rows = [cpu_row(paths, os.cpu_count() or 1)]
    if device != "cuda":
        rows.append(skipped("decoders", "GPU decoders", "no GPU"))
        return rows
    datas = [path.read_bytes() for path in paths]
    return [*gpu_rows(datas, seconds), *rows]


def _sentence(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    paths = images(args.workdir / "images", args.images)
    rows = measure(paths, args.device, args.seconds)
    args.out.write_text(json.dumps({"rows": rows}, indent=1))
    for r in rows:
        rate = r.get("images_per_s")
        busy = (r.get("sm_busy") or {}).get("mean")
        print(f"{r['subject']:<48} {rate if rate is not None else r.get('reason')!s:>10}"
              f"  busy {busy}")  # fmt: skip


if __name__ == "__main__":
    main()
