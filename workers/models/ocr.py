"""The built-in OCR model: PP-OCRv4 det / cls / rec ONNX files shipped by rapidocr-onnxruntime,
run on Kiln's engines, with lines from many images batched together.

- `prepare` (task thread): decode, the working image, the detector's resized input.
- `infer` (the model's Batcher): the detector over a batch of images, then DB boxes.
- `finish` (task thread): crop the lines, pass them through two inner Batchers owned by the
  pipeline — the angle classifier, then the recogniser — shared by every image in flight on
  the worker's threads, and decode the text.

Parameters come from rapidocr's config.yaml; its pure pre/post-processing is reused (see
`ocr_det`, `ocr_lines`), never its ONNX sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from kiln.app.core.errors import InputError
from kiln.workers.batching import Batcher
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Prepared
from kiln.workers.models.ocr_config import load_config
from kiln.workers.models.ocr_det import DET_AXES, Detection, Page, to_original
from kiln.workers.models.ocr_lines import (
    REC_MAX_WIDTH,
    LineReader,
    Reading,
    Strip,
    group_indices,
    strip_axes,
)
from kiln.workers.preprocess import decode_image, stack

# Images per detector call on a GPU (only equal input shapes share a tensor). On a CPU one:
# a batch of large images is no faster per image there and holds all their activations
# (measured on 1504×736 inputs: 0.25 s/image alone, 0.32 s in fours, ~1 GB more).
DET_GPU_BATCH = 8
LINE_MAX_BATCH = 32  # strips per classifier / recogniser call: short, so many fit
QUEUED_BATCHES = 4  # strips may wait this many batches ahead of the inner engines

_LINE = pa.struct(
    [
        ("text", pa.string()),
        ("score", pa.float32()),
        ("box", pa.list_(pa.list_(pa.float32(), 2), 4)),
    ]
)
FIELDS = [pa.field("text", pa.string()), pa.field("lines", pa.list_(_LINE))]

In = TypeVar("In")
Out = TypeVar("Out")


class OcrPipeline:
    name = "ocr"
    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads

    def __init__(self, engines: EngineFactory, *, max_pixels: int) -> None:
        config = self.config = load_config()
        self.max_pixels = max_pixels
        det_batch = DET_GPU_BATCH if engines.choice.on_gpu else 1
        self.det_engine = engines.build("ocr-det", config.det_model, det_batch, axes=DET_AXES)
        cls_axes = strip_axes(config.cls_height, config.cls_width, config.cls_width)
        cls_engine = engines.build("ocr-cls", config.cls_model, LINE_MAX_BATCH, axes=cls_axes)
        rec_axes = strip_axes(config.rec_height, config.rec_width, REC_MAX_WIDTH)
        rec_engine = engines.build("ocr-rec", config.rec_model, LINE_MAX_BATCH, axes=rec_axes)
        self.max_batch = self.det_engine.max_batch
        engines_used = (self.det_engine, cls_engine, rec_engine)
        self.backend = ", ".join(dict.fromkeys(e.backend for e in engines_used))  # one, usually
        self.detection = Detection(config)
        self.reader = LineReader(config, cls_engine, rec_engine)
        self._det_input = self.det_engine.inputs[0].name
        self._det_prepare = self.detection.normalizer()
        self.cls_batcher: Batcher[Strip, tuple[str, float]] = _inner(
            self.reader.classify, cls_engine.max_batch, engines, "ocr-cls"
        )
        self.rec_batcher: Batcher[Strip, Reading] = _inner(
            self.reader.recognise, rec_engine.max_batch, engines, "ocr-rec"
        )

    def prepare(self, data: bytes | str) -> Prepared:
        if isinstance(data, str):
            raise InputError("This model takes images, not text.")
        # JPEGs decode straight to a smaller DCT scale when far larger than the working image.
        decoded = decode_image(data, max_pixels=self.max_pixels, draft_to=self.config.max_side_len)
        page = self.detection.page(decoded)
        return Prepared(self.detection.input(page), {"page": page})

    def infer(self, rows: Sequence[Prepared]) -> list[Any]:
        """Boxes per image. Inputs keep each image's aspect, so only equal shapes (common in
        bulk scans) share an engine call; the others run one by one."""
        boxes: list[Any] = [None] * len(rows)
        for group in group_indices([r.pixels.shape for r in rows]):
            feeds = {self._det_input: stack([rows[i].pixels for i in group])}
            outputs = self.det_engine.infer(feeds, {self._det_input: self._det_prepare})
            for i, probabilities in zip(group, next(iter(outputs.values())), strict=True):
                boxes[i] = self.detection.boxes(probabilities, rows[i].meta["page"])
        return boxes

    def finish(self, row: Prepared, raw: Any) -> dict[str, Any]:
        page: Page = row.meta["page"]
        boxes: np.ndarray = raw
        lines = []
        if len(boxes):
            readings = self._read(page, boxes)
            for box, (text, score) in zip(to_original(boxes, page), readings, strict=True):
                if score >= self.config.text_score:
                    lines.append(_line(box, text, score))
        return {"text": "\n".join(str(line["text"]) for line in lines), "lines": lines}

    def _read(self, page: Page, boxes: np.ndarray) -> list[tuple[str, float]]:
        """Crops → upright (classifier) → text (recogniser), through the shared Batchers."""
        reader = self.reader
        crops = reader.crops(page.image, boxes)
        angles = _through(self.cls_batcher, [reader.cls_strip(c) for c in crops])
        crops = [reader.upright(c, a) for c, a in zip(crops, angles, strict=True)]
        readings = _through(self.rec_batcher, [reader.rec_strip(c) for c in crops])
        return [reader.text(r) for r in readings]

    def close(self) -> None:
        """Stop the inner Batchers (after finishing the strips already queued)."""
        self.cls_batcher.close()
        self.rec_batcher.close()


def _inner(
    fn: Callable[[Sequence[In]], Sequence[Out]], max_batch: int, engines: EngineFactory, name: str
) -> Batcher[In, Out]:
    runners = engines.runners
    return Batcher(
        fn,
        max_batch=max_batch,
        max_delay_s=engines.settings.max_delay_s,
        runners=runners,
        name=f"batcher-{name}",
        greedy=True,  # `_through` announces an image's strips: a lone image runs at once
        max_queued=QUEUED_BATCHES * max_batch * runners,
    )


def _through(batcher: Batcher[In, Out], rows: list[In]) -> list[Out]:
    """All rows submitted under one announcement (so a runner does not start a batch with
    only the first of them), then their results in order."""
    with batcher.expect(len(rows)) as announced:
        futures = [announced.submit(row) for row in rows]
    return [future.result() for future in futures]


def _line(box: np.ndarray, text: str, score: float) -> dict[str, Any]:
    return {
        "text": text,
        "score": round(score, 4),
        "box": [[round(float(x), 1), round(float(y), 1)] for x, y in box],
    }
