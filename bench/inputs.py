"""Benchmark inputs, generated: deterministic JPEGs with varied content (no downloads)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


def link_folder(folder: Path, paths: list[Path]) -> Path:
    """A fresh folder of symbolic links to `paths` (`kiln run` reads every image of a folder)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in paths:
        (folder / path.name).symlink_to(path)
    return folder


def picture(seed: int, size: tuple[int, int]) -> Image.Image:
    """Gradients, shapes and noise: compresses like a photo, not like a flat test card."""
    rng = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            np.sin(x / rng.uniform(20, 90) + rng.uniform(0, 6)) * 60 + rng.uniform(60, 190)
            for _ in range(3)
        ],
        axis=-1,
    )
    base += rng.normal(0, 12, base.shape)
    image = Image.fromarray(np.clip(base + y[..., None] * 0.1, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
        box = [
            x0,
            y0,
            x0 + int(rng.integers(10, width // 2)),
            y0 + int(rng.integers(10, height // 2)),
        ]
        fill = tuple(int(c) for c in rng.integers(0, 255, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    return image.filter(ImageFilter.GaussianBlur(0.8))


def jpeg(seed: int, size: tuple[int, int], quality: int = 88) -> bytes:
    buffer = io.BytesIO()
    picture(seed, size).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def make_images(folder: Path, count: int, size: tuple[int, int]) -> list[Path]:
    """`count` JPEGs in `folder`, made once and reused (file names carry the size)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"img-{size[0]}x{size[1]}-{i:05d}.jpg"
        if not path.exists():
            path.write_bytes(jpeg(i, size))
        paths.append(path)
    return paths


WORDS = (
    "kiln", "batch", "engine", "harbour", "quartz", "violet", "meadow", "signal", "copper",
    "lantern", "river", "orbit", "granite", "falcon", "pepper", "winter", "anchor", "timber",
)  # fmt: skip


def sentences(count: int) -> list[str]:
    """`count` different short sentences (text-embed inputs)."""
    n = len(WORDS)
    return [
        f"The {WORDS[i % n]} near the {WORDS[(i * 7 + 3) % n]} was {WORDS[(i * 5 + 1) % n]} {i}."
        for i in range(count)
    ]


def make_word_images(folder: Path, count: int) -> list[Path]:
    """`count` PNGs of two rendered words each (OCR inputs), made once and reused."""
    from devstack.images import words

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    n = len(WORDS)
    for i in range(count):
        path = folder / f"words-{i:05d}.png"
        if not path.exists():
            path.write_bytes(
                words(f"{WORDS[i % n]} {WORDS[(i * 5 + 2) % n]}", font_size=40 + i % 3 * 6)
            )
        paths.append(path)
    return paths
