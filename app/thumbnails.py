"""Small JPEG previews of a job's image inputs, made by the API from the item's own source (what
search answers link to). An original never leaves whole: only a thumbnail of at most
`THUMBNAIL_PX` (on request up to `MAX_PX`) on its longer side.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Sequence

from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError
from sqlalchemy.orm import Session

from kiln.app import jobs, sources, tenants
from kiln.app.catalog import get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db import queries
from kiln.app.db.models import Item
from kiln.app.results import S3Factory
from kiln.app.storage import ObjectStore
from kiln.app.storage.s3 import read_object

THUMBNAIL_PX = 256  # enough to recognise a picture in a results table, ~10 KB as JPEG
MAX_PX = 512  # the most a caller may ask for: a preview still, never the original
JPEG_QUALITY = 80
ORIENTATION = 0x0112  # the EXIF tag


def item_thumbnail(
    session: Session,
    store: ObjectStore,
    s3: S3Factory,
    settings: Settings,
    tenant: str,
    job_id: str,
    key: str,
    side: int = THUMBNAIL_PX,
    boxes: bool = False,
) -> bytes:
    """A JPEG thumbnail of item `key` of the tenant's job `job_id` (404 for another tenant's),
    at most `side` pixels (up to `MAX_PX`) on its longer side; with `boxes`, the detections
    the model answered for it drawn on."""
    job = jobs.get_job(session, tenant, job_id)
    model = get_model(session, job.model, tenant)
    if model.input != "image":
        raise InputError(f"Job {job_id} ran a text model; its items have no pictures to show.")
    item = queries.item_by_key(session, job.id, key)
    if item is None:
        raise NotFoundError(f"Job {job_id} has no item {key!r}.")
    data = _item_bytes(session, store, s3, settings, tenant, item)
    drawn = detections(item) if boxes else []
    return thumbnail(
        data, settings.max_image_pixels, f"Item {item.key!r}", min(side, MAX_PX), drawn
    )


def detections(item: Item) -> list[Labelled]:
    """The item's detector answer as (label, box) pairs; none for other models' answers."""
    found = (item.outputs or {}).get("detections") or []
    return [
        (str(d.get("label", "?")), d["box"])
        for d in found
        if isinstance(d, dict) and isinstance(d.get("box"), list)
    ]


def _item_bytes(
    session: Session,
    store: ObjectStore,
    s3: S3Factory,
    settings: Settings,
    tenant: str,
    item: Item,
) -> bytes:
    """The item's bytes, read as the worker's fetcher reads them (`app/sources.py`); an s3://
    input only while the tenant may still read its bucket."""
    source = item.source or ""
    if (stored := sources.store_key(source)) is not None:
        return store.get(stored)
    if source.startswith("s3://"):
        tenants.check_buckets(session, tenant, [source])
        return read_object(s3(), source, settings.max_upload_bytes)
    raise ConflictError(
        f"Item {item.key!r} was read from {source or 'nowhere'}, which only `kiln run` on its "
        "own machine reads; the API has no picture of it."
    )


def thumbnail(
    data: bytes,
    max_pixels: int,
    name: str = "The image",
    side: int = THUMBNAIL_PX,
    boxes: Sequence[Labelled] = (),
) -> bytes:
    """`data` (any image Pillow reads) as a JPEG at most `side` pixels a side, upright, with
    `boxes` (in the upright original's pixels, as the detector answers them) drawn on it."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > max_pixels:
                raise InputError(
                    f"{name} is {image.width}×{image.height} pixels, more than Kiln decodes."
                )
            upright_width = image.height if _turned(image) else image.width
            image.draft("RGB", (side, side))  # JPEG: decode at a reduced scale
            small = ImageOps.exif_transpose(image).convert("RGB")
            small.thumbnail((side, side))
            if boxes:
                draw_boxes(small, boxes, small.width / upright_width)
    except UnidentifiedImageError:
        raise InputError(f"{name} is not a picture Kiln can read.") from None
    except (OSError, Image.DecompressionBombError) as error:  # truncated, or a bomb
        raise InputError(f"{name} cannot be shown as a picture: {error}.") from None
    out = io.BytesIO()
    small.save(out, "JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


Labelled = tuple[str, Sequence[float]]  # a label and its box: x1, y1, x2, y2
BOX_COLOURS = ("#ff3b30", "#34c759", "#0a84ff", "#ff9f0a", "#bf5af2", "#64d2ff")


def _turned(image: Image.Image) -> bool:
    """Whether the EXIF orientation turns the picture a quarter (its width is its height)."""
    return image.getexif().get(ORIENTATION, 1) in (5, 6, 7, 8)


def draw_boxes(image: Image.Image, boxes: Sequence[Labelled], scale: float) -> None:
    """Outline each box (scaled from the original's pixels) with its label above it; one
    colour per label, so the same thing reads the same on every thumbnail."""
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    width = max(1, round(min(image.size) / 128))
    for label, box in boxes:
        if len(box) != 4:
            continue
        x1, y1, x2, y2 = (float(v) * scale for v in box)
        colour = BOX_COLOURS[zlib.crc32(label.encode()) % len(BOX_COLOURS)]
        pen.rectangle((x1, y1, max(x1, x2), max(y1, y2)), outline=colour, width=width)
        text_at = (x1 + width, max(0.0, y1 - 11))
        pen.rectangle(pen.textbbox(text_at, label, font=font), fill=colour)
        pen.text(text_at, label, fill="#ffffff", font=font)
