"""A labelled set of near-duplicates, generated: distinct pictures, copies of some of them
(resized, re-encoded, cropped, brightened), each copy labelled with its original.

Each picture layers choices made from its seed: a background (flat, linear or radial
gradient, waves, a blotchy noise texture), grain, shapes, sometimes text, a blur. Pictures are
far apart for phash (median 32 bits between two of them in bench/README.md's run; a handful of
pairs in 80,000 within 12 bits, as chance has it for 64-bit hashes).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter, ImageFont

SIZE = (640, 480)
ORIGINAL_QUALITY = 90  # originals and most copies are JPEGs, as photos are
# A picture with nothing on its background (a flat colour or a faint gradient) has no structure
# for a hash or an embedder to hold on to: any two such are alike, and a resize alone moved
# their phash by 20-30 bits. Photos seldom are that empty, so every picture has shapes.
MIN_SHAPES = 2
WORDS = ("kiln", "batch", "harbour", "quartz", "violet", "meadow", "signal", "copper", "orbit")

Rng = np.random.Generator


@dataclass(frozen=True)
class Item:
    """One image of the set. `source` is the original it was made from (its own seed for an
    original; a distractor has no copies); `transform` says how it was made."""

    key: str
    source: int
    transform: str
    data: bytes

    @property
    def is_copy(self) -> bool:
        return self.transform not in ("original", "distractor")


# --- pictures ---------------------------------------------------------------------------------


def _colour(rng: Rng) -> np.ndarray:
    return rng.integers(0, 256, 3).astype(np.float32)


def _blend(rng: Rng, t: np.ndarray) -> np.ndarray:
    """Two random colours mixed by `t` (0…1 per pixel): an H×W×3 float array."""
    c0, c1 = _colour(rng), _colour(rng)
    mixed: np.ndarray = c0 + (c1 - c0) * t[..., None]
    return mixed


def _grid() -> tuple[np.ndarray, np.ndarray]:
    y, x = np.mgrid[0 : SIZE[1], 0 : SIZE[0]].astype(np.float32)
    return x / SIZE[0], y / SIZE[1]


def _flat(rng: Rng) -> np.ndarray:
    return np.broadcast_to(_colour(rng), (SIZE[1], SIZE[0], 3)).copy()


def _linear(rng: Rng) -> np.ndarray:
    x, y = _grid()
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * x + np.sin(angle) * y
    return _blend(rng, (t - t.min()) / np.ptp(t))


def _radial(rng: Rng) -> np.ndarray:
    x, y = _grid()
    cx, cy = rng.uniform(0, 1, 2)
    t = np.hypot(x - cx, (y - cy) * SIZE[1] / SIZE[0])
    return _blend(rng, t / t.max())


def _waves(rng: Rng) -> np.ndarray:
    x, y = _grid()
    angle, cycles = rng.uniform(0, np.pi), rng.uniform(2, 14)
    phase = (np.cos(angle) * x + np.sin(angle) * y) * 2 * np.pi * cycles
    return _blend(rng, (np.sin(phase + rng.uniform(0, 6)) + 1) / 2)


def _clouds(rng: Rng) -> np.ndarray:
    """Random colours on a coarse grid, smoothly enlarged: a blotchy texture."""
    cells = int(rng.integers(3, 12))
    small = rng.integers(0, 256, (cells, cells * 4 // 3 + 1, 3), dtype=np.uint8)
    big = Image.fromarray(small).resize(SIZE, Image.Resampling.BICUBIC)
    return np.asarray(big, dtype=np.float32)


BACKGROUNDS: tuple[Callable[[Rng], np.ndarray], ...] = (_flat, _linear, _radial, _waves, _clouds)


def _shapes(draw: ImageDraw.ImageDraw, rng: Rng, count: int) -> None:
    width, height = SIZE
    for _ in range(count):
        x0, y0 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
        x1 = int(rng.integers(x0 + 20, min(width, x0 + width // 2) + 1))
        y1 = int(rng.integers(y0 + 20, min(height, y0 + height // 2) + 1))
        fill = tuple(int(c) for c in _colour(rng))
        kind = rng.random()
        if kind < 0.4:
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif kind < 0.8:
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        else:
            corners = [(int(rng.integers(0, width)), int(rng.integers(0, height))) for _ in "abc"]
            draw.polygon(corners, fill=fill)


def _text(draw: ImageDraw.ImageDraw, rng: Rng, lines: int) -> None:
    for _ in range(lines):
        font = ImageFont.load_default(size=int(rng.integers(24, 72)))
        words = " ".join(str(rng.choice(WORDS)) for _ in range(int(rng.integers(1, 4))))
        xy = (int(rng.integers(0, SIZE[0] // 2)), int(rng.integers(0, SIZE[1] - 80)))
        draw.text(xy, words, fill=tuple(int(c) for c in _colour(rng)), font=font)


def picture(seed: int) -> Image.Image:
    """A background of one of five kinds, shapes (and sometimes text) over it, some grain,
    a blur."""
    rng = np.random.default_rng(seed)
    base = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))](rng)
    base += rng.normal(0, rng.uniform(0, 14), base.shape)  # sensor-like grain, or none
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    _shapes(draw, rng, int(rng.integers(MIN_SHAPES, 12)))
    if rng.random() < 0.4:
        _text(draw, rng, int(rng.integers(1, 5)))
    return image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0, 1.5))))


# --- copies -----------------------------------------------------------------------------------


def encode(image: Image.Image, quality: int = ORIGINAL_QUALITY) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def _resized(image: Image.Image, scale: float) -> Image.Image:
    size = (round(image.width * scale), round(image.height * scale))
    return image.resize(size, Image.Resampling.BICUBIC)


def _cropped(image: Image.Image, keep: float, rng: Rng | None) -> Image.Image:
    """`keep` of each side: centred (rng None), or at a random offset."""
    width, height = round(image.width * keep), round(image.height * keep)
    spare_x, spare_y = image.width - width, image.height - height
    if rng is None:
        left, top = spare_x // 2, spare_y // 2
    else:
        left, top = int(rng.integers(0, spare_x + 1)), int(rng.integers(0, spare_y + 1))
    return image.crop((left, top, left + width, top + height))


def copies(image: Image.Image, rng: Rng) -> dict[str, bytes]:
    """The six copies of one original, by transformation name."""
    return {
        "resize-0.5": encode(_resized(image, 0.5)),
        "resize-0.75": encode(_resized(image, 0.75)),
        "jpeg-q30": encode(image, quality=30),
        "crop-90-centre": encode(_cropped(image, 0.9, None)),
        "crop-80-offset": encode(_cropped(image, 0.8, rng)),
        "brighter-1.15": encode(ImageEnhance.Brightness(image).enhance(1.15)),
    }


TRANSFORMS = tuple(copies(Image.new("RGB", (10, 10)), np.random.default_rng(0)))


# --- the set ----------------------------------------------------------------------------------


def originals_and_copies(seed: int) -> Iterator[Item]:
    image = picture(seed)
    yield Item(f"{seed:05d}-original", seed, "original", encode(image))
    for name, data in copies(image, np.random.default_rng(10**6 + seed)).items():
        yield Item(f"{seed:05d}-{name}", seed, name, data)


def labelled_set(originals: int, distractors: int) -> list[Item]:
    """`originals` pictures with six copies each, then `distractors` other pictures alone:
    (1 + 6) × originals + distractors items. Seeds follow on, so every picture differs."""
    items = [item for seed in range(originals) for item in originals_and_copies(seed)]
    for seed in range(originals, originals + distractors):
        items.append(Item(f"{seed:05d}-distractor", seed, "distractor", encode(picture(seed))))
    return items
