"""YOLOv8-style detectors: the built-in `detector` and any registered `detect` model.

The built-in is NudeNet's YOLOv8n (320 px) body-part/nudity detector, not a general object
detector: its labels are NudeNet's (FACE_FEMALE, BUTTOCKS_EXPOSED, …). A registered detector
brings its own labels, preprocessing and NMS settings; both decode boxes and run NMS here, a
batch at a time in NumPy.

Where the batch runs on a device (a CUDA torch engine, or the device stand-in), the dense part
runs there first (`YoloCandidates`, torch): each anchor's best class and score, and each
image's `CANDIDATES` best-scored anchors, best first — ~8 KB an image crosses back, not the
whole output (22 × 2,100 floats for the built-in, 185 KB). The host then keeps those over the
score floor, maps them back and runs NMS, as it does with a CPU engine's whole output; the same
candidates, so the same boxes. An image with more anchors over the floor than that is taken
again with every anchor (`cut_short`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kiln.app.catalog.model_spec import Detection, ImageModelSpec, Preprocessing
from kiln.workers.device.image_stages import DEFAULT_OPTIONS, DeviceOptions, DevicePost
from kiln.workers.engines.base import Engine
from kiln.workers.models.base import Answers, Batch, names_of, numeric, row_errors
from kiln.workers.models.image_model import ImageModelPredictor
from kiln.workers.prep.images import placement_row
from kiln.workers.prep.pixels import Placement

LABELS = (
    "FEMALE_GENITALIA_COVERED", "FACE_FEMALE", "BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED",
    "FEMALE_GENITALIA_EXPOSED", "MALE_BREAST_EXPOSED", "ANUS_EXPOSED", "FEET_EXPOSED",
    "BELLY_COVERED", "FEET_COVERED", "ARMPITS_COVERED", "ARMPITS_EXPOSED", "FACE_MALE",
    "BELLY_EXPOSED", "MALE_GENITALIA_EXPOSED", "ANUS_COVERED", "FEMALE_BREAST_COVERED",
    "BUTTOCKS_COVERED",
)  # fmt: skip

_DETECTION = pa.struct(
    [("label", pa.string()), ("score", pa.float32()), ("box", pa.list_(pa.float32(), 4))]
)
FIELDS = [pa.field("detections", pa.list_(_DETECTION))]


def model_path() -> Path:
    import nudenet

    return Path(nudenet.__file__).parent / "320n.onnx"


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float) -> list[int]:
    """Greedy non-maximum suppression over one image's xyxy boxes; indices kept, best first."""
    order = np.argsort(-scores, kind="stable")
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    keep: list[int] = []
    while order.size:
        best, rest = int(order[0]), order[1:]
        keep.append(best)
        iou = _iou(boxes[best], boxes[rest], areas[best], areas[rest])
        order = rest[iou <= iou_threshold]
    return keep


def _iou(box: np.ndarray, others: np.ndarray, area: Any, areas: np.ndarray) -> np.ndarray:
    x1 = np.maximum(box[..., 0], others[..., 0])
    y1 = np.maximum(box[..., 1], others[..., 1])
    x2 = np.minimum(box[..., 2], others[..., 2])
    y2 = np.minimum(box[..., 3], others[..., 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    return np.asarray(inter / np.maximum(area + areas - inter, 1e-9))


BATCHED_NMS_MAX = 256  # candidates per image above which NMS runs image by image (memory)


def batched_nms(boxes: np.ndarray, valid: np.ndarray, iou_threshold: float) -> np.ndarray:
    """Greedy NMS for many images at once: `boxes` (images, M, 4) each image's candidates
    sorted best first, `valid` (images, M) which are real. The kept mask; one Python step per
    candidate rank, the same work for every image at once."""
    areas = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
    iou = _iou(boxes[:, :, None, :], boxes[:, None, :, :], areas[:, :, None], areas[:, None, :])
    alive = valid.copy()
    keep = np.zeros_like(valid)
    for i in range(boxes.shape[1]):
        kept = alive[:, i]
        keep[:, i] = kept
        alive[:, i + 1 :] &= ~(kept[:, None] & (iou[:, i, i + 1 :] > iou_threshold))
    return keep


@dataclass(frozen=True)
class Candidates:
    """A batch's boxes above the score floor, flat, sorted by image then score (best first)."""

    image: np.ndarray  # which image of the batch each belongs to
    boxes: np.ndarray  # (n, 4) xyxy in original pixels
    scores: np.ndarray
    classes: np.ndarray


def candidates(raw: np.ndarray, fits: np.ndarray, score_threshold: float) -> Candidates:
    """YOLOv8 outputs [images, 4 + classes, anchors] → boxes in original pixels, each image's
    fit (scale across, scale down, upright width, height: `prep.images.placement_row`). The
    best class is looked for only at the anchors over the floor (its score is the max)."""
    class_scores = raw[:, 4:, :]
    scores = class_scores.max(axis=1)  # images, anchors
    image, anchor = np.nonzero(scores >= score_threshold)
    class_ids = class_scores[image, :, anchor].argmax(axis=1)  # the first best, as argmax
    box = raw[image, :4, anchor]  # candidates, (cx, cy, w, h)
    return _placed(image, anchor, box, scores[image, anchor], class_ids, fits)


def posted_candidates(posted: np.ndarray, fits: np.ndarray, score_threshold: float) -> Candidates:
    """`candidates` from what `YoloCandidates` copied back: [images, 7, K] (`POSTED`), each
    image's best-scored anchors; the same candidates, in the same order."""
    scores = posted[:, SCORE, :]
    image, slot = np.nonzero(scores >= score_threshold)
    picked = posted[image, :, slot]  # candidates, 7
    anchor = picked[:, ANCHOR].astype(np.int64)
    class_ids = picked[:, CLASS].astype(np.int64)
    return _placed(image, anchor, picked[:, :4], picked[:, SCORE], class_ids, fits)


def _placed(image: np.ndarray, anchor: np.ndarray, box: np.ndarray, scores: np.ndarray,
            class_ids: np.ndarray, fits: np.ndarray) -> Candidates:  # fmt: skip
    """Candidates' boxes (cx, cy, w, h in model pixels) in their images' original pixels,
    clipped to them; sorted by image, best first, ties in anchor order."""
    cx, cy, w, h = (box[:, i] for i in range(4))
    fit = fits[image].astype(box.dtype)
    scales = np.stack([fit[:, 0], fit[:, 1], fit[:, 0], fit[:, 1]], axis=1)
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1) / scales
    limits = np.stack([fit[:, 2], fit[:, 3], fit[:, 2], fit[:, 3]], axis=1)
    boxes = np.clip(boxes, 0, limits)
    order = np.lexsort((anchor, -scores, image))
    return Candidates(image[order], boxes[order], scores[order], class_ids[order])


# What `YoloCandidates` copies back per image and candidate, as float32 (exact for class and
# anchor indices up to 2**24): the box as the model gave it, then these.
CLASS, SCORE, ANCHOR = 4, 5, 6
POSTED = 7
CANDIDATES = 300  # anchors a device copies back per image (YOLOv8's max_det): ~8 KB


def best_anchors(raw: Any, k: int | None) -> Any:
    """Torch, on the outputs' device: YOLOv8 outputs [images, 4 + classes, anchors] → each
    image's `k` best-scored anchors (None: every anchor), best first, as [images, 7, k]: cx,
    cy, w, h, best class, its score, anchor index. Per batch, 13 torch calls (each releases the
    GIL: a stage's calls stay few, `device/stages.py`)."""
    import torch

    with torch.inference_mode():
        if raw.dtype != torch.float32:  # a half-precision engine's: anchor indices stay exact
            raw = raw.float()
        scores, best = raw[:, 4:].max(dim=1)  # the first best on ties, as NumPy's argmax
        anchors = int(raw.shape[2])
        _top, index = scores.topk(anchors if k is None else min(k, anchors), dim=1)
        table = torch.cat((raw[:, :4], torch.stack((best.float(), scores), 1)), 1)
        picked = table.gather(2, index[:, None].expand(-1, SCORE + 1, -1))
        return torch.cat((picked, index[:, None].float()), 1)


class YoloCandidates:
    """The detector's `DevicePost` (`device/image_stages.py`): its candidates made on the
    engine's device, so a few KB an image cross back, not its dense output."""

    def __init__(self, name: str, labels: int, score_threshold: float,
                 k: int = CANDIDATES) -> None:  # fmt: skip
        self.name, self.labels = name, labels
        self.score_threshold, self.k = score_threshold, k

    def on_device(self, outputs: list[Any], whole: bool = False) -> list[Any]:
        raw = outputs[0]
        _check_shape(self.name, tuple(raw.shape), self.labels)
        return [best_anchors(raw, None if whole else self.k)]

    def cut_short(self, host: np.ndarray) -> bool:
        """An image whose last candidate copied back is still over the floor may have had
        more (a batch with fewer anchors than `k` came back whole)."""
        full = host.shape[2] >= self.k
        return full and bool((host[:, SCORE, -1] >= self.score_threshold).any())


def _check_shape(name: str, shape: tuple[int, ...], labels: int) -> None:
    if len(shape) != 3 or shape[1] != 4 + labels:
        raise ValueError(
            f"Model {name!r} returned shape {list(shape)}, not [N, {4 + labels}, anchors] "
            f"(4 box values and {labels} class scores per anchor)."
        )


def _kept(found: Candidates, images: int, iou_threshold: float) -> np.ndarray:
    """Which candidates NMS keeps (per image, greedily, best first)."""
    counts = np.bincount(found.image, minlength=images)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    keep = np.zeros(len(found.image), dtype=bool)
    small = counts <= BATCHED_NMS_MAX
    if small.any() and len(found.image):
        width = int(counts[small].max())
        rank = np.arange(len(found.image)) - starts[found.image]
        chosen = small[found.image]
        slot = np.searchsorted(np.flatnonzero(small), found.image[chosen])
        padded = np.zeros((int(small.sum()), width, 4), dtype=found.boxes.dtype)
        valid = np.zeros((int(small.sum()), width), dtype=bool)
        padded[slot, rank[chosen]] = found.boxes[chosen]
        valid[slot, rank[chosen]] = True
        keep[chosen] = batched_nms(padded, valid, iou_threshold)[slot, rank[chosen]]
    for i in np.flatnonzero(~small):  # a crowded image: its own loop, memory O(candidates)
        span = slice(starts[i], starts[i] + counts[i])
        keep[
            np.arange(span.start, span.stop)[
                nms(found.boxes[span], found.scores[span], iou_threshold)
            ]
        ] = True
    return keep


def detection_lists(
    raw: np.ndarray,
    fits: np.ndarray,
    *,
    score_threshold: float,
    iou_threshold: float,
    labels: Sequence[str] = LABELS,
    max_boxes: int | None = None,
) -> pa.Array:
    """Each image's detections, best first, at most `max_boxes`, as a list of {label, score,
    box} in Arrow: the whole batch's decoding and NMS in NumPy."""
    found = candidates(raw, fits, score_threshold)
    return detections(found, raw.shape[0], iou_threshold=iou_threshold, labels=labels,
                      max_boxes=max_boxes)  # fmt: skip


def detections(
    found: Candidates,
    images: int,
    *,
    iou_threshold: float,
    labels: Sequence[str] = LABELS,
    max_boxes: int | None = None,
) -> pa.Array:
    """`detection_lists` from a batch's candidates: NMS per image, the first `max_boxes`."""
    keep = _kept(found, images, iou_threshold)
    if max_boxes is not None:  # the first max_boxes kept of each image
        image = found.image[keep]
        rank = np.arange(len(image)) - np.searchsorted(image, image)
        keep[np.flatnonzero(keep)[rank >= max_boxes]] = False
    image, classes = found.image[keep], found.classes[keep]
    boxes = np.round(found.boxes[keep].astype(np.float64), 1)
    values = pa.StructArray.from_arrays(
        [
            names_of(labels, classes),
            numeric(np.round(found.scores[keep].astype(np.float64), 4)),
            pa.FixedSizeListArray.from_arrays(numeric(boxes), 4),
        ],
        names=["label", "score", "box"],
    )
    offsets = np.concatenate([[0], np.cumsum(np.bincount(image, minlength=images))])
    return pa.ListArray.from_arrays(numeric(offsets, pa.int32()), values)


def decode_yolo(
    raw: np.ndarray,
    fit: Placement,
    *,
    score_threshold: float,
    iou_threshold: float,
    labels: Sequence[str] = LABELS,
    max_boxes: int | None = None,
) -> list[dict[str, Any]]:
    """One image's YOLOv8 output [4 + classes, anchors] → boxes in original pixels, best
    first, at most `max_boxes` of them (the batch path, for one image)."""
    fits = np.asarray([placement_row(fit)], dtype=np.float32)
    lists = detection_lists(
        raw[np.newaxis], fits, score_threshold=score_threshold, iou_threshold=iou_threshold,
        labels=labels, max_boxes=max_boxes,
    )  # fmt: skip
    return list(lists[0].as_py())


class YoloPredictor(ImageModelPredictor):
    """A registered detector: output [N, 4 + classes, anchors], boxes as centre and size in
    model pixels, one score per label; letterboxed unless its spec says squash."""

    kind = "detect"

    def __init__(
        self, name: str, engine: Engine, spec: dict[str, Any], *, max_pixels: int,
        detection: Detection | None = None, **kw: Any,
    ) -> None:  # fmt: skip
        declared = ImageModelSpec.from_dict(spec)
        self.labels = tuple(declared.labels)
        # before the stages are built: the device step's score floor
        self.detection = detection or declared.detection()
        super().__init__(name, engine, spec, max_pixels=max_pixels, **kw)

    def device_post(self) -> DevicePost:
        return YoloCandidates(self.name, len(self.labels), self.detection.score_threshold)

    def infer(self, batch: Batch) -> Answers:
        output, failed = self._output(batch)
        assert batch.meta is not None  # each image's fit: where its boxes map back to
        setting = self.detection
        if self.posted:  # the device made the candidates (and checked the shape)
            found = posted_candidates(output, batch.meta, setting.score_threshold)
        else:
            _check_shape(self.name, output.shape, len(self.labels))
            found = candidates(output, batch.meta, setting.score_threshold)
        columns = {
            "detections": detections(
                found, len(batch), iou_threshold=setting.iou_threshold, labels=self.labels,
                max_boxes=setting.max_boxes,
            )
        }  # fmt: skip
        if not failed:
            return Answers(len(batch), columns)
        errors, refused = row_errors(len(batch), failed)
        return Answers(len(batch), columns, errors, refused)


class DetectorPredictor(YoloPredictor):
    """The built-in detector: NudeNet's labels, letterboxed to `size`, pixels scaled to 0–1."""

    @staticmethod
    def spec(size: int = 320) -> dict[str, Any]:
        return {"input_size": size, "labels": list(LABELS), "fit": "letterbox"}

    @classmethod
    def preprocessing(cls, size: int = 320) -> Preprocessing:
        """What its engine is fed (the loader gives GPU engines the normalisation)."""
        return ImageModelSpec.from_dict(cls.spec(size)).preprocessing(cls.kind)

    def __init__(
        self,
        engine: Engine,
        *,
        max_pixels: int,
        gpu_decode: bool = True,
        device_options: DeviceOptions = DEFAULT_OPTIONS,
        size: int = 320,
        score_threshold: float = 0.25,
        iou_threshold: float = 0.45,
    ) -> None:
        spec = self.spec(size)
        super().__init__(
            "detector", engine, spec, max_pixels=max_pixels, gpu_decode=gpu_decode,
            device_options=device_options,
            # NudeNet's answer keeps every box NMS keeps.
            detection=Detection(score_threshold, iou_threshold, max_boxes=None),
        )  # fmt: skip
