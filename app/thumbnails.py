"""Small JPEG previews of a job's image inputs, made by the API from the item's own source (what
search answers link to). An original never leaves whole: only a thumbnail of at most
`THUMBNAIL_PX` (on request up to `MAX_PX`) on its longer side.
"""

from __future__ import annotations

import io

from PIL import Image, ImageOps, UnidentifiedImageError
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


def item_thumbnail(
    session: Session,
    store: ObjectStore,
    s3: S3Factory,
    settings: Settings,
    tenant: str,
    job_id: str,
    key: str,
    side: int = THUMBNAIL_PX,
) -> bytes:
    """A JPEG thumbnail of item `key` of the tenant's job `job_id` (404 for another tenant's),
    at most `side` pixels (up to `MAX_PX`) on its longer side."""
    job = jobs.get_job(session, tenant, job_id)
    model = get_model(session, job.model, tenant)
    if model.input != "image":
        raise InputError(f"Job {job_id} ran a text model; its items have no pictures to show.")
    item = queries.item_by_key(session, job.id, key)
    if item is None:
        raise NotFoundError(f"Job {job_id} has no item {key!r}.")
    data = _item_bytes(session, store, s3, settings, tenant, item)
    return thumbnail(data, settings.max_image_pixels, f"Item {item.key!r}", min(side, MAX_PX))


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
    data: bytes, max_pixels: int, name: str = "The image", side: int = THUMBNAIL_PX
) -> bytes:
    """`data` (any image Pillow reads) as a JPEG at most `side` pixels a side, upright."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > max_pixels:
                raise InputError(
                    f"{name} is {image.width}×{image.height} pixels, more than Kiln decodes."
                )
            image.draft("RGB", (side, side))  # JPEG: decode at a reduced scale
            small = ImageOps.exif_transpose(image).convert("RGB")
            small.thumbnail((side, side))
    except UnidentifiedImageError:
        raise InputError(f"{name} is not a picture Kiln can read.") from None
    except (OSError, Image.DecompressionBombError) as error:  # truncated, or a bomb
        raise InputError(f"{name} cannot be shown as a picture: {error}.") from None
    out = io.BytesIO()
    small.save(out, "JPEG", quality=JPEG_QUALITY)
    return out.getvalue()
