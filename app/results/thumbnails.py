"""Small JPEG previews of a job's image inputs, made by the API from the item's own source (what
search answers link to). An original never leaves whole: only a thumbnail of at most
`THUMBNAIL_PX` (on request up to `MAX_PX`) on its longer side.

A video's sampled frame (an item with a `frame_time_s`) is decoded by the prep processes' own
reader (`kiln.app.video.reader`), from the keyframe before its moment forward to the frame on
screen then — the frame the worker gave the model, by the same rule. A frame the worker fails
(past a cut file's end, damaged, or decoded from a damaged frame) is a 404 with a sentence,
never another frame's pixels. The video's bytes are kept a few minutes, so a strip of its
frames reads it once.
"""

from __future__ import annotations

import io
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cachetools import TTLCache
from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError
from sqlalchemy.orm import Session

from kiln.app import sources, video
from kiln.app.catalog.catalog import get_model
from kiln.app.core.config import Settings
from kiln.app.core.errors import ConflictError, InputError, NotFoundError
from kiln.app.db import queries
from kiln.app.db.models import Item
from kiln.app.jobs import jobs
from kiln.app.storage import ObjectStore
from kiln.app.storage.base import S3Factory
from kiln.app.storage.s3 import read_object
from kiln.app.tenants import tenants
from kiln.app.video.container import reason
from kiln.app.video.reader import VideoReader

THUMBNAIL_PX = 256  # enough to recognise a picture in a results table, ~10 KB as JPEG
MAX_PX = 512  # the most a caller may ask for: a preview still, never the original
JPEG_QUALITY = 80
ORIENTATION = 0x0112  # the EXIF tag
VIDEO_CACHE_BYTES = 128 * 2**20  # videos kept for their other frames' thumbnails, at most
VIDEO_CACHE_S = 300.0  # ... and for this long


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
        raise InputError(f"Job {job.id} ran a text model; its items have no pictures to show.")
    item = queries.item_by_key(session, job.id, key)
    if item is None:
        raise NotFoundError(f"Job {job.id} has no item {key!r}.")
    drawn = detections(item) if boxes else []
    name, side = f"Item {item.key!r}", min(side, MAX_PX)
    if item.frame_time_s is not None:  # a video's frame: its video, decoded at that moment
        name = f"The video of item {item.key!r}"
        if (item.source or "").startswith("s3://"):  # kept bytes too: while it may read them
            tenants.check_buckets(session, tenant, [item.source or ""])
        data = _VIDEOS.get(
            item.source or "",
            lambda: _item_bytes(session, store, s3, settings, tenant, item),
        )
        pixels = settings.max_image_pixels
        return frame_thumbnail(data, item.frame_time_s, pixels, name, side, drawn)
    data = _item_bytes(session, store, s3, settings, tenant, item)
    if video.container_of(data[: video.HEAD_BYTES]) is not None:
        # a video not yet split into its frames (or refused whole): its first frame
        return frame_thumbnail(data, 0.0, settings.max_image_pixels, name, side, drawn)
    return thumbnail(data, settings.max_image_pixels, name, side, drawn)


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
    return _jpeg(small)


def _jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def frame_thumbnail(
    data: bytes | Path,
    time_s: float,
    max_pixels: int,
    name: str = "The video",
    side: int = THUMBNAIL_PX,
    boxes: Sequence[Labelled] = (),
) -> bytes:
    """The frame of the video in `data` (its bytes, or a file) on screen at `time_s` seconds
    from its first frame, as a JPEG at most `side` pixels a side, with `boxes` (in the frame's
    pixels, as the detector answers a frame) drawn on. Not a video: an InputError; no frame
    decodable at that moment: a NotFoundError; each with a sentence."""
    frame = video_frame(data, time_s, max_pixels, name)
    width, height = frame.width, frame.height
    step = max(1, min(width, height, max(width, height) // (2 * side)))
    # RGB, as the worker gives it to the model; reduced by FFmpeg first when it is large
    rgb = frame.to_ndarray(
        format="rgb24", width=max(2, width // step), height=max(2, height // step),
        interpolation="AREA",
    )  # fmt: skip
    small = Image.fromarray(rgb)
    small.thumbnail((side, side))
    if boxes:
        draw_boxes(small, boxes, small.width / width)
    return _jpeg(small)


def video_frame(data: bytes | Path, time_s: float, max_pixels: int, name: str) -> Any:
    """PyAV's frame of the video on screen at `time_s`, read by the worker's reader
    (`kiln.app.video.reader`) from the packets up to that moment: a frame the worker would fail
    (past the end, damaged, built on a damaged frame) is refused the same way, never drawn."""
    import av

    try:
        reader = VideoReader(data, threads=1, until=time_s)  # requests in parallel: a core each
    except InputError as error:
        raise InputError(f"{name} cannot be read as a video. {error}") from None
    try:
        width, height = reader.stream.codec_context.width, reader.stream.codec_context.height
        if width * height > max_pixels:
            raise InputError(f"{name} is {width}×{height} pixels, more than Kiln decodes.")
        return _frame_at(reader, time_s, name)
    except (av.error.FFmpegError, ValueError) as error:  # past the sentences above: FFmpeg's
        raise NotFoundError(
            f"{name} could not be decoded at {time_s:.3f} s ({reason(error)})."
        ) from None
    finally:
        reader.close()


def _frame_at(reader: VideoReader, time_s: float, name: str) -> Any:
    """The reader's frame at `time_s`, its refusals in the thumbnail's sentences (a 404)."""
    index = reader.index
    if not index.times:
        raise NotFoundError(f"{name} holds no frames (its stream is empty or unreadable).")
    if index.ends_before(time_s):
        raise NotFoundError(
            f"{name} ends at {index.end_s:.1f} s; it has no frame at {time_s:.3f} s."
        )
    try:
        return reader.frame(time_s)
    except InputError:
        raise NotFoundError(
            f"{name} is damaged at {index.time_shown_at(time_s):.3f} s: the frame shown then "
            "could not be decoded."
        ) from None


class _VideoBytes:
    """Videos' bytes by source, kept `VIDEO_CACHE_S` (a strip's thumbnails ask for one video
    many times at once: the first request reads it, the others wait for it). A video over
    half the budget is read each time, never kept."""

    def __init__(self, most: int = VIDEO_CACHE_BYTES, seconds: float = VIDEO_CACHE_S) -> None:
        self._kept: TTLCache[str, bytes] = TTLCache(most, seconds, getsizeof=len)
        self._lock = threading.Lock()
        self._reading: dict[str, threading.Lock] = {}

    def get(self, source: str, read: Callable[[], bytes]) -> bytes:
        if not source:
            return read()
        with self._lock:
            data = self._kept.get(source)
            if data is not None:
                return data
            reading = self._reading.setdefault(source, threading.Lock())
        with reading:
            try:
                with self._lock:
                    data = self._kept.get(source)
                if data is None:
                    data = read()
                    if len(data) <= self._kept.maxsize // 2:
                        with self._lock:
                            self._kept[source] = data
                return data
            finally:
                with self._lock:
                    if self._reading.get(source) is reading:
                        del self._reading[source]


_VIDEOS = _VideoBytes()


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
