"""The built-in OCR model: PP-OCRv4 det / cls / rec ONNX files shipped by rapidocr-onnxruntime,
run on Kiln's engines, with lines from many images batched together.

- prep (a prep process, `workers/models/ocr_prep.py`): decode, the working image, the detector's
  resized input — shapes vary, so they travel as objects, not slots.
- `infer` (the model's Batcher): the detector over a batch of images, then DB boxes.
- `finish` (the chunk's thread): crop every line of the block's images, pass them through two
  inner Batchers owned by the predictor — the angle classifier, then the recogniser — shared by
  every chunk in flight on the worker, and decode the text.

Parameters come from rapidocr's config.yaml; its pure pre/post-processing is reused (see
`ocr_det`, `ocr_lines`), never its ONNX sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.workers.batching import Batcher, ListShape, Part, queued_policy
from kiln.workers.engines.select import EngineFactory
from kiln.workers.models.base import Answers, Batch, row_errors
from kiln.workers.models.ocr_config import load_config
from kiln.workers.models.ocr_det import DET_AXES, Detection, Page, to_original
from kiln.workers.models.ocr_lines import (
    REC_MAX_WIDTH,
    LineReader,
    Strip,
    group_indices,
    strip_axes,
)
from kiln.workers.prep.pixels import stack
from kiln.workers.prep.spec import prep_spec

# Images per detector call on a GPU (only equal input shapes share a tensor). On a CPU one:
# a batch of large images is no faster per image there and holds all their activations.
DET_GPU_BATCH = 8
LINE_MAX_BATCH = 32  # strips per classifier / recogniser call: short, so many fit

_LINE = pa.struct(
    [
        ("text", pa.string()),
        ("score", pa.float32()),
        ("box", pa.list_(pa.list_(pa.float32(), 2), 4)),
    ]
)
FIELDS = [pa.field("text", pa.string()), pa.field("lines", pa.list_(_LINE))]


class OcrPredictor:
    name = "ocr"
    max_runners = 64  # ONNX Runtime sessions are safe to run from many threads

    def __init__(self, engines: EngineFactory, *, max_pixels: int) -> None:
        config = self.config = load_config()
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
        self.prep = prep_spec("kiln.workers.models.ocr_prep:OcrPrep", {"max_pixels": max_pixels})
        self._det_input = self.det_engine.inputs[0].name
        self._det_prepare = self.detection.normalizer()
        self.cls_batcher: Batcher[list[Strip], list[Any]] = _inner(
            self.reader.classify, cls_engine.max_batch, engines, "ocr-cls"
        )
        self.rec_batcher: Batcher[list[Strip], list[Any]] = _inner(
            self.reader.recognise, rec_engine.max_batch, engines, "ocr-rec"
        )

    def infer(self, batch: Batch) -> Answers:
        """Boxes per image. Inputs keep each image's aspect, so only equal shapes (common in
        bulk scans) share an engine call; the others run one by one."""
        rows = batch.objects or []
        raw: list[Any] = [None] * len(rows)
        for group in group_indices([pixels.shape for pixels, _page in rows]):
            feeds = {self._det_input: stack([rows[i][0] for i in group])}
            outputs = self.det_engine.infer(feeds, {self._det_input: self._det_prepare})
            for i, probabilities in zip(group, next(iter(outputs.values())), strict=True):
                page = rows[i][1]
                raw[i] = (page, self.detection.boxes(probabilities, page))
        return Answers(len(rows), raw=raw)

    def finish(self, answers: Answers) -> Answers:
        """The text of every image of the block: all their lines go through the inner
        Batchers together, so lines of many images share the classifier's and recogniser's
        batches."""
        raw, errors = answers.raw or [], answers.error_list()
        pages = [(i, value) for i, value in enumerate(raw) if value is not None and not errors[i]]
        outputs: list[dict[str, Any] | None] = [None] * answers.rows
        failed: dict[int, Exception] = {}
        for (i, _), lines in zip(pages, self._read([v for _i, v in pages]), strict=True):
            if isinstance(lines, Exception):
                failed[i] = lines
            else:
                outputs[i] = {
                    "text": "\n".join(str(line["text"]) for line in lines),
                    "lines": lines,
                }
        columns = {
            f.name: pa.array([o[f.name] if o else None for o in outputs], f.type) for f in FIELDS
        }
        if failed:
            more, _refused = row_errors(answers.rows, failed)
            errors = [e or m for e, m in zip(errors, more, strict=True)]
        return Answers(answers.rows, columns, errors if any(errors) else None, answers.refused)

    def _read(self, pages: list[tuple[Page, np.ndarray]]) -> list[list[dict[str, Any]] | Exception]:
        """Crops → upright (classifier) → text (recogniser), for many pages at once."""
        reader = self.reader
        crops = [reader.crops(page.image, boxes) if len(boxes) else [] for page, boxes in pages]
        flat = [crop for page_crops in crops for crop in page_crops]
        angles = _through(self.cls_batcher, [reader.cls_strip(c) for c in flat])
        upright = [
            crop if isinstance(a, Exception) else reader.upright(crop, a)
            for crop, a in zip(flat, angles, strict=True)
        ]
        readings = _through(
            self.rec_batcher,
            [reader.rec_strip(c) for c, a in zip(upright, angles, strict=True)],
        )
        results: list[list[dict[str, Any]] | Exception] = []
        start = 0
        for (page, boxes), page_crops in zip(pages, crops, strict=True):
            stop = start + len(page_crops)
            results.append(self._lines(page, boxes, angles[start:stop], readings[start:stop]))
            start = stop
        return results

    def _lines(
        self, page: Page, boxes: np.ndarray, angles: list[Any], readings: list[Any]
    ) -> list[dict[str, Any]] | Exception:
        failure = next((r for r in [*angles, *readings] if isinstance(r, Exception)), None)
        if failure is not None:
            return failure
        lines = []
        if len(boxes):
            texts = [self.reader.text(r) for r in readings]
            for box, (text, score) in zip(to_original(boxes, page), texts, strict=True):
                if score >= self.config.text_score:
                    lines.append(_line(box, text, score))
        return lines

    def close(self) -> None:
        """Stop the inner Batchers (after finishing the strips already queued)."""
        self.cls_batcher.close()
        self.rec_batcher.close()


def _inner(
    fn: Callable[[Sequence[Strip]], Sequence[Any]],
    max_batch: int,
    engines: EngineFactory,
    name: str,
) -> Batcher[list[Strip], list[Any]]:
    """A Batcher of strips for one inner engine: greedy (`_through` announces a block's
    strips, so a lone image runs at once), queued as a model's Batcher is."""

    def batch(parts: Sequence[Part[list[Strip]]]) -> list[Any]:
        return list(fn([strip for p in parts for strip in p.block[p.start : p.stop]]))

    policy = queued_policy(engines.settings, max_batch, engines.runners)
    return Batcher(batch, ListShape(), policy, name=f"batcher-{name}")


def _through(batcher: Batcher[list[Strip], list[Any]], rows: list[Strip]) -> list[Any]:
    """All rows as one block (a failed row holds its exception)."""
    if not rows:
        return []
    with batcher.expect(len(rows)) as announced:
        future = announced.submit(rows)
    return future.result()


def _line(box: np.ndarray, text: str, score: float) -> dict[str, Any]:
    return {
        "text": text,
        "score": round(score, 4),
        "box": [[round(float(x), 1), round(float(y), 1)] for x, y in box],
    }
