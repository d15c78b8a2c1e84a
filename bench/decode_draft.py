"""Decode + resize cost per image, before and after drafted JPEG decoding (a script, not a case).

    .venv/bin/python -m bench.decode_draft [--count 300] [--rounds 5] [--folder DIR]

Times, on the benchmark's generated 640×480 JPEGs, what a worker does per image before the
batch: bytes → the model's uint8 input, for ResNet's 224 centre crop and the detector's 320
letterbox. Paths: `full` (no draft at all), `before` (workers/prep/pixels.py as committed at
HEAD, loaded from git), `after` (the working tree) and `after-exact` (the working tree's path
for every other format: no draft, no folded crop). Reports CPU ms per image, the best of
`rounds` passes, which is the least disturbed by other processes on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from bench.inputs import make_images
from kiln.workers.prep import pixels

ROOT = Path(__file__).resolve().parent.parent
MAX_PIXELS = 50_000_000
Path_ = Callable[[bytes], np.ndarray]


def committed_preprocess() -> ModuleType:
    """workers/prep/pixels.py as committed at HEAD, as a module of its own."""
    source = subprocess.run(
        ["git", "show", "HEAD:workers/prep/pixels.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    spec = importlib.util.spec_from_loader("preprocess_head", loader=None)
    assert spec
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    # This repository's own committed file, for a before/after comparison.
    exec(compile(source, "HEAD:workers/prep/pixels.py", "exec"), module.__dict__)  # noqa: S102
    return module


def paths(old: ModuleType) -> dict[str, dict[str, Path_]]:
    new = pixels

    def full(data: bytes) -> pixels.Decoded:
        decoded = new.decode_image(data, max_pixels=MAX_PIXELS)
        return new.Decoded(decoded.image, decoded.width, decoded.height)  # not marked JPEG

    def crop_sizer(w: int, h: int) -> tuple[int, int]:
        return new.crop_resize_size(w, h, 224)

    def fit_sizer(w: int, h: int) -> tuple[int, int]:
        return new.letterbox_size(w, h, 320)

    side = old.resize_side(224)
    return {
        "resnet-224": {
            "full": lambda d: old.center_crop(old.decode_image(d, max_pixels=MAX_PIXELS), 224),
            "before": lambda d: old.center_crop(
                old.decode_image(d, max_pixels=MAX_PIXELS, draft_to=side), 224
            ),
            "after": lambda d: new.center_crop(
                new.decode_image(d, max_pixels=MAX_PIXELS, draft_to=crop_sizer), 224
            ),
            "after-exact": lambda d: new.center_crop(full(d), 224),
        },
        "detector-320": {
            "full": lambda d: old.letterbox(old.decode_image(d, max_pixels=MAX_PIXELS), 320)[0],
            "before": lambda d: old.letterbox(
                old.decode_image(d, max_pixels=MAX_PIXELS, draft_to=320), 320
            )[0],
            "after": lambda d: new.letterbox(
                new.decode_image(d, max_pixels=MAX_PIXELS, draft_to=fit_sizer), 320
            )[0],
        },
    }


def cpu_ms_per_image(run: Path_, inputs: list[bytes]) -> float:
    start = time.process_time()
    for data in inputs:
        run(data)
    return (time.process_time() - start) * 1000 / len(inputs)


def measure(inputs: list[bytes], rounds: int) -> None:
    for model, variants in paths(committed_preprocess()).items():
        best = {name: float("inf") for name in variants}
        for _ in range(rounds):  # interleaved, so drift on the machine hits every variant
            for name, run in variants.items():
                best[name] = min(best[name], cpu_ms_per_image(run, inputs))
        reference = variants["full"](inputs[0])
        for name, run in variants.items():
            diff = np.abs(run(inputs[0]).astype(float) - reference).mean()
            print(
                f"{model:13} {name:15} {best[name]:6.2f} ms/image  "
                f"before÷this {best['before'] / best[name]:4.2f}  "
                f"full÷this {best['full'] / best[name]:4.2f}  mean|Δ| vs full {diff:.4f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "kiln-draft")
    args = parser.parse_args()
    files = make_images(args.folder, args.count, (640, 480))
    inputs = [path.read_bytes() for path in files]
    print(f"{len(inputs)} JPEGs of 640×480, {args.rounds} rounds, Python {sys.version.split()[0]}")
    measure(inputs, args.rounds)


if __name__ == "__main__":
    main()
