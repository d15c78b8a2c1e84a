"""Generated test images: nothing is downloaded, nothing large is committed."""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw


def photo(seed: int, size: tuple[int, int] = (640, 480), fmt: str = "JPEG") -> bytes:
    """A deterministic picture with shapes and a gradient, encoded as `fmt`."""
    rng = random.Random(seed)
    image = Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randint(0, size[0] - 10), rng.randint(0, size[1] - 10)
        x1, y1 = rng.randint(x0 + 5, size[0]), rng.randint(y0 + 5, size[1])
        colour = tuple(rng.randint(0, 255) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x0, y0, x1, y1], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def solid(colour: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return buffer.getvalue()


def truncated_jpeg(seed: int = 0) -> bytes:
    data = photo(seed)
    return data[: len(data) // 3]


def words(text: str, size: tuple[int, int] = (640, 160), font_size: int = 48) -> bytes:
    """Dark words on a light background, in DejaVu Sans (matplotlib ships the font)."""
    from pathlib import Path

    import matplotlib
    from PIL import ImageFont

    font_path = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    image = Image.new("RGB", size, (245, 245, 240))
    ImageDraw.Draw(image).text(
        (24, 40), text, fill=(20, 20, 20), font=ImageFont.truetype(str(font_path), font_size)
    )
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def near_copy(data: bytes, scale: float = 0.8, quality: int = 70) -> bytes:
    """The same picture resized and re-encoded as JPEG: a near-duplicate."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    image = image.resize((int(image.width * scale), int(image.height * scale)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()
