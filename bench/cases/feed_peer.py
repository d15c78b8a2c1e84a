"""The `feed` case's in-process parts, each in a fresh interpreter (bench.child):

- `peer`: what a PyTorch user writes to feed a model: a `DataLoader` over the files, one worker
  process per core, batches of 64; each image drafted to the smallest JPEG scale that covers
  the resize, short side resized to 256 (bilinear), centre crop, float CHW, normalised; the main
  process runs the ONNX model on each batch. Fresh loader per size, its workers started inside
  the timed window, so their start-up cancels in the marginal rate; one loader over one batch
  runs first, untimed, so the first size does not pay this process's first-run costs alone.
- `decode-fit`: Kiln's own decode + fit (`kiln.workers.prep.pixels`, the default classify spec)
  alone on one core: the CPU an image costs before anything else Kiln does.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from bench.models import MAX_PIXELS, labels
from bench.results import CaseResult, Sized, marginal

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
CROP_RATIO = 0.875  # 224 of 256
BATCH = 64
WARM_UP = 8  # decode-fit: images decoded before the timed loop (first-call costs)


def measure(args: dict[str, Any]) -> CaseResult:
    if args["what"] == "peer":
        return _peer(args)
    return _decode_fit(args)


class Files(Dataset[torch.Tensor]):
    """The images at `paths`, each as a normalised float32 CHW tensor of `size`²."""

    def __init__(self, paths: list[str], size: int) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.from_numpy(prepare(self.paths[index], self.size))


def prepare(path: str, size: int) -> np.ndarray:
    source = Image.open(path)
    scale = round(size / CROP_RATIO) / min(source.size)
    resized = (round(source.width * scale), round(source.height * scale))
    source.draft("RGB", resized)  # a JPEG decodes at the smallest DCT scale still covering it
    image = source.convert("RGB").resize(resized, Image.Resampling.BILINEAR)
    left, top = (resized[0] - size) // 2, (resized[1] - size) // 2
    pixels = np.asarray(image.crop((left, top, left + size, top + size)), dtype=np.float32)
    return np.ascontiguousarray(((pixels / 255 - MEAN) / STD).transpose(2, 0, 1))


def _cpu_seconds() -> float:
    """This process and its reaped children (the loader's workers, joined when it ends)."""
    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in usages)


def _feed(session: ort.InferenceSession, paths: list[str], size: int) -> Sized:
    name = session.get_inputs()[0].name
    cpu, started, seen = _cpu_seconds(), time.perf_counter(), 0
    loader = DataLoader(Files(paths, size), batch_size=BATCH, num_workers=os.cpu_count() or 1)
    for batch in loader:
        seen += len(session.run(None, {name: batch.numpy()})[0])  # the output is read back
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    if seen != len(paths):
        raise RuntimeError(f"the peer ran {seen} of {len(paths)} images")
    return Sized(len(paths), round(seconds, 3), {"subject": round(cpu, 3)})


def _peer(args: dict[str, Any]) -> CaseResult:
    session = ort.InferenceSession(args["onnx"], providers=["CPUExecutionProvider"])
    size = int(args["size"])
    _feed(session, args["small"][:BATCH], size)  # first-run costs in this process stay out
    small, large = _feed(session, args["small"], size), _feed(session, args["large"], size)
    extra = {"num_workers": os.cpu_count(), "batch_size": BATCH}
    return marginal("feed-peer", args["model"], small, large, extra)


def _decode_fit(args: dict[str, Any]) -> CaseResult:
    from kiln.app.catalog.model_spec import ImageModelSpec
    from kiln.workers.prep.pixels import decode_image, fit_image, fit_size

    pre = ImageModelSpec(input_size=int(args["size"]), labels=labels(3)).preprocessing("classify")
    datas = [Path(f).read_bytes() for f in args["files"]]

    def sizer(width: int, height: int) -> tuple[int, int]:
        return fit_size(pre, width, height)  # as the image prep (ImagePrep) drafts

    def one(data: bytes) -> None:
        fit_image(decode_image(data, max_pixels=MAX_PIXELS, draft_to=sizer), pre)

    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # one core
    for data in datas[:WARM_UP]:  # first-call costs (imports, tables) stay out
        one(data)
    cpu, started = time.thread_time(), time.perf_counter()
    for data in datas:
        one(data)
    seconds, cpu = time.perf_counter() - started, time.thread_time() - cpu
    return CaseResult(
        "feed-decode-fit",
        args["model"],
        items=len(datas),
        seconds=round(seconds, 3),
        cpu_seconds={"subject": round(cpu, 4)},
        extra={"what": "decode_image + fit_image, one thread on one core"},
    )
