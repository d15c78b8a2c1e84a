"""Regenerate the sample images in examples/: printed words on varied backgrounds.

Run: python scripts/make_examples.py  (deterministic; the outputs are committed)
"""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter, ImageFont

OUT = Path(__file__).resolve().parent.parent / "examples"
FONT_DIRS = [Path("/usr/share/fonts/truetype/dejavu"), Path("/usr/share/fonts")]

CARDS = [
    ("invoice.jpg", ["INVOICE 2041", "Total due: 318.50 EUR", "Pay by 30 November"]),
    ("poster.png", ["KILN", "batch inference", "on every GPU"]),
    ("receipt.jpg", ["Corner Bakery", "2 croissants  4.20", "1 espresso    2.10"]),
    ("sign.jpg", ["NO PARKING", "Mon-Fri 8am-6pm"]),
    ("note.png", ["Meeting moved", "to Thursday 3pm", "Room 42"]),
    ("label.jpg", ["Fragile", "Handle with care", "This side up"]),
]


def font(size: int, bold: bool) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    name = "DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf"
    for folder in FONT_DIRS:
        for path in folder.rglob(name):
            return ImageFont.truetype(str(path), size)
    return ImageFont.load_default(size=size)


def card(lines: list[str], rng: random.Random) -> Image.Image:
    width, height = 800, 120 + 90 * len(lines)
    top = tuple(rng.randint(200, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), top)
    draw = ImageDraw.Draw(image)
    for y in range(0, height, 4):  # a soft gradient so it is not a flat synthetic field
        shade = tuple(max(0, c - y // 12) for c in top)
        draw.rectangle([0, y, width, y + 4], fill=shade)
    y = 60
    for i, line in enumerate(lines):
        size = 64 if i == 0 else 44
        colour = tuple(rng.randint(0, 70) for _ in range(3))
        draw.text((50 + rng.randint(0, 30), y), line, fill=colour, font=font(size, i == 0))
        y += size + 36
    return image.filter(ImageFilter.GaussianBlur(0.6))


def main() -> None:
    rng = random.Random(7)  # noqa: S311 - reproducible pictures, not secrets
    OUT.mkdir(exist_ok=True)
    for name, lines in CARDS:
        image = card(lines, rng)
        if name.endswith(".jpg"):
            image.save(OUT / name, quality=85)
        else:
            image.save(OUT / name, optimize=True)
    print(f"wrote {len(CARDS)} images to {OUT}")


if __name__ == "__main__":
    main()
