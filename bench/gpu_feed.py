"""`feed` on a GPU host (issue 23): `kiln run` with ResNet-50 on the PyTorch CUDA engine against a
PyTorch DataLoader peer, over the same 640×480 JPEGs, with the GPU's busy share sampled by NVML
while each runs. No Postgres or Redis: the embedded `kiln run` and an in-process peer only, so it
runs on a bare GPU host from the offline bundle (docs/gpu.md, "The offline bundle").

    python -m bench.gpu_feed --workdir DIR --out FILE.json [--images 6000] [--decode gpu,cpu]

Marginal rates, as the CPU `feed` case: each subject at two sizes (a third and all of the
images), (n_large − n_small) / (t_large − t_small), so start-up and model load cancel.
- `kiln-gpu-decode`: `kiln run` as it runs by default there: prep processes check headers, the
  engine process decodes each batch with nvJPEG and fits it on the GPU.
- `kiln-cpu-decode`: the same with `KILN_GPU_DECODE=false`: the prep processes (one per core)
  decode and fit into shared-memory slots, the engine gets uint8 batches.
- `peer`: a DataLoader (one worker process per core, Pillow draft decode + resize + crop,
  batches of 64, pinned memory) feeding ResNet-50 written in plain torch (the bench's seed-0
  weights) in FP16, channels_last: what a PyTorch user writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.inputs import jpeg, link_folder
from bench.models import export_resnet, labels

SIZE = (640, 480)
SIDE = 224
PEER_BATCH = 64
SERVICE_VARS = ("KILN_DATABASE_URL", "KILN_BROKER_URL", "KILN_STORAGE_URL", "KILN_S3_ENDPOINT_URL")
BUSY_INTERVAL_S = 0.05  # NVML averages over its own period (~1/6 s): finer adds nothing


@dataclass
class Run:
    items: int
    seconds: float
    cpu_s: float
    sm_busy: list[float] = field(default_factory=list)  # NVML utilisation samples, percent
    # the engine process's device stages, as each said when it closed: where the time went
    pipelines: list[str] = field(default_factory=list)


@dataclass
class Subject:
    name: str
    small: Run
    large: Run

    @property
    def rate(self) -> float:
        seconds = self.large.seconds - self.small.seconds
        return (self.large.items - self.small.items) / seconds if seconds > 0 else 0.0

    @property
    def sm_busy(self) -> float:
        samples = self.large.sm_busy
        return sum(samples) / len(samples) if samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "marginal_items_per_s": round(self.rate, 1),
            "sm_busy_pct_mean_large_run": round(self.sm_busy, 1),
            "small": asdict(self.small),
            "large": asdict(self.large),
        }


class Busy:
    """NVML's GPU utilisation (share of time a kernel ran) every `interval` s while the block
    runs."""

    def __init__(self, interval: float = BUSY_INTERVAL_S) -> None:
        self.samples: list[float] = []
        self._interval = interval
        self._stop = threading.Event()

    def __enter__(self) -> Busy:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no NVML (a dry run on a CPU host): nothing to sample
            self._thread = threading.Thread(target=lambda: None)
            self._thread.start()
            return self

        def sample() -> None:
            while not self._stop.wait(self._interval):
                self.samples.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _write(args: tuple[Path, int]) -> None:
    path, seed = args
    if not path.exists():
        path.write_bytes(jpeg(seed, SIZE))


def images(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"img-{i:06d}.jpg" for i in range(count)]
    with ProcessPoolExecutor() as pool:
        list(pool.map(_write, [(p, i) for i, p in enumerate(paths)], chunksize=64))
    return paths


def kiln_run(
    workdir: Path,
    onnx: Path | None,
    folder: Path,
    env_extra: dict[str, str],
    engine: str,
    model: str = "resnet50",
    wrap: Sequence[str] = (),
) -> Run:
    """One `kiln run` over `folder`; `onnx` is registered as `model` first, or None for a
    built-in model (the detector), which is run by name. `wrap`: a command it runs under
    (py-spy's, bench/gpu_profile.py)."""
    tag = "-".join(env_extra.values())
    prefix = "kiln" if model == "resnet50" else f"kiln-{model}"
    data = workdir / f"{prefix}-{folder.name}-{tag}"
    shutil.rmtree(data, ignore_errors=True)
    # `kiln run` is embedded whatever the service's URLs say, and `models add` must register
    # into its SQLite too: the URLs of a service (bench.gpu's part f) are not passed on.
    env = {k: v for k, v in os.environ.items() if k not in SERVICE_VARS}
    # info: the log keeps each model's device stages' verdict (`device_stages_verdicts`). Kiln's
    # defaults otherwise, the content cache on (issue 38): each run has a fresh data dir, so
    # nothing is found in it, and what a user's run pays for the lookup is paid here too.
    env |= {"KILN_DATA_DIR": str(data), "KILN_ENGINE": engine, "KILN_LOG_LEVEL": "info",
            "KILN_LOG_FORMAT": "json", **env_extra}  # fmt: skip
    kiln = [sys.executable, "-m", "kiln.app.cli"]
    if onnx is not None:
        names = workdir / "labels.txt"
        names.write_text("\n".join(labels(1000)) + "\n")
        add = [*kiln, "models", "add", model, "--onnx", str(onnx), "--input-size", str(SIDE)]
        subprocess.run([*add, "--labels", str(names)], env=env, check=True, capture_output=True)
    items = len(list(folder.iterdir()))
    run = [*kiln, "run", str(folder), "--model", model, "-o", str(data / "out.parquet")]
    log = (workdir / f"{data.name}.log").open("wb")
    with Busy() as busy:
        started = time.perf_counter()
        proc = subprocess.Popen([*wrap, *run], env=env, stdout=log, stderr=subprocess.STDOUT)
        _pid, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"kiln run failed; see {log.name}")
    _all_done(data / "out.parquet", items, log.name)
    cpu_s = round(usage.ru_utime + usage.ru_stime, 2)
    return Run(
        items, round(seconds, 3), cpu_s, busy.samples, device_stages_verdicts(Path(log.name))
    )


def device_stages_verdicts(log: Path) -> list[str]:
    """What each model's device stages said as they closed (`DeviceStages.close`), from a JSON
    log."""
    said = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            message = json.loads(line).get("message", "")
        except (ValueError, AttributeError):
            continue  # py-spy's or a library's own line
        if isinstance(message, str) and " pipeline closed: " in message:
            said.append(message)
    return said


def _all_done(results: Path, items: int, log: str) -> None:
    """A run whose items failed measured nothing: say so instead of a rate."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    status = pq.read_table(results, columns=["status", "error"])
    done = pc.sum(pc.equal(status["status"], "succeeded")).as_py() or 0
    if status.num_rows != items or done != items:
        failed = pc.filter(status["error"], pc.is_valid(status["error"]))
        why = failed[0].as_py() if len(failed) else "missing rows"
        raise RuntimeError(f"kiln run answered {done} of {items} items (first error: {why}); {log}")


def peer(paths: list[Path], workers: int, device: str) -> Run:
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    from bench.models import _resnet

    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    class Files(Dataset[Any]):
        def __len__(self) -> int:
            return len(paths)

        def __getitem__(self, i: int) -> Any:
            opened = Image.open(paths[i])
            opened.draft("RGB", (256, 256))
            image: Image.Image = opened.convert("RGB")
            scale = 256 / min(image.size)
            image = image.resize((round(image.width * scale), round(image.height * scale)))
            left, top = (image.width - SIDE) // 2, (image.height - SIDE) // 2
            image = image.crop((left, top, left + SIDE, top + SIDE))
            x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
            x = x.view(SIDE, SIDE, 3).permute(2, 0, 1).float().div_(255)
            return (x - mean) / std

    torch.manual_seed(0)
    cuda = device == "cuda"
    model: Any = _resnet(50).eval().to(device)
    model = model.half().to(memory_format=torch.channels_last) if cuda else model
    loader = DataLoader(Files(), batch_size=PEER_BATCH, num_workers=workers, pin_memory=cuda)
    cpu0 = time.process_time()
    with Busy() as busy, torch.inference_mode():
        started = time.perf_counter()
        for batch in loader:
            x = batch.to(device, non_blocking=True)
            x = x.half().to(memory_format=torch.channels_last) if cuda else x
            model(x).argmax(1).cpu()
        seconds = time.perf_counter() - started
    return Run(len(paths), round(seconds, 3), round(time.process_time() - cpu0, 2), busy.samples)


def kiln_subject(
    name: str,
    workdir: Path,
    onnx: Path | None,
    folders: tuple[Path, Path],
    env_extra: dict[str, str],
    engine: str,
    model: str = "resnet50",
) -> Subject:
    """`kiln run` over the small then the large folder: one marginal subject."""
    small, large = (kiln_run(workdir, onnx, f, env_extra, engine, model) for f in folders)
    return Subject(name, small, large)


def peer_subject(paths: list[Path], workers: int, device: str) -> Subject:
    """The peer over a third of `paths`, then all of them, after an untimed warm-up run."""
    peer(paths[: PEER_BATCH * 2], workers, device)  # untimed: first-call costs (cuDNN)
    small = peer(paths[: len(paths) // 3], workers, device)
    return Subject("peer", small, peer(paths, workers, device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=6000)
    parser.add_argument("--decode", default="gpu,cpu")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--engine", default="torch-cuda", help="KILN_ENGINE of the Kiln runs")
    parser.add_argument("--peer-device", default="cuda")
    args = parser.parse_args()
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    paths = images(work / "images", args.images)
    small = link_folder(work / "small", paths[: len(paths) // 3])
    large = link_folder(work / "large", paths)
    onnx = export_resnet(50, work / "resnet50.onnx")
    cores = os.cpu_count() or 1
    results: list[Subject] = []
    for decode in args.decode.split(","):
        extra = {"KILN_GPU_DECODE": "true" if decode == "gpu" else "false"}
        name = f"kiln-{decode}-decode"
        results.append(kiln_subject(name, work, onnx, (small, large), extra, args.engine))
        print(json.dumps(results[-1].as_dict())[:300], flush=True)
    if not args.skip_peer:
        results.append(peer_subject(paths, cores, args.peer_device))
    report = {
        "host_cores": cores,
        "images": len(paths),
        "subjects": [s.as_dict() for s in results],
        "ratios_vs_peer": {
            s.name: round(s.rate / results[-1].rate, 3)
            for s in results[:-1]
            if not args.skip_peer and results[-1].rate
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "subjects"}, indent=2))
    for s in results:
        print(f"{s.name}: {s.rate:.0f} images/s marginal, GPU busy {s.sm_busy:.0f}%")


if __name__ == "__main__":
    main()
