"""The detector's candidates made on the engine's device (`detect.YoloCandidates`, torch; here
torch's CPU, in a child process so this one stays torch-free as a worker is): decoded on the
host, the same boxes as `decode_yolo` over the whole output, image for image, on a real-shaped
output (the built-in's 22 × 2,100) with known boxes, crowds, ties and noise under the floor."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kiln.workers.models.detect import (
    ANCHOR,
    CLASS,
    POSTED,
    SCORE,
    YoloCandidates,
    decode_yolo,
    detections,
    posted_candidates,
)
from kiln.workers.prep.images import placement_row
from kiln.workers.prep.pixels import Letterbox
from tests.support import run_torch_child

CLASSES, ANCHORS, IMAGES = 18, 2100, 5
SCORE_FLOOR, IOU = 0.25, 0.45
FITS = [Letterbox(scale=1.6, width=200, height=100), Letterbox(scale=0.5, width=640, height=480),
        Letterbox(scale=1.0, width=320, height=320), Letterbox(scale=0.25, width=1280, height=960),
        Letterbox(scale=0.5, width=480, height=640)]  # fmt: skip

CHILD = """
import sys
from pathlib import Path
import numpy as np
import torch
from kiln.workers.models.detect import best_anchors
folder = Path(sys.argv[1])
raw = torch.from_numpy(np.load(folder / "raw.npy"))
for name, k in (("posted", 300), ("short", 8), ("whole", None)):
    np.save(folder / f"{name}.npy", best_anchors(raw, k).numpy())
np.save(folder / "half.npy", best_anchors(raw.half(), 300).numpy())
"""


def real_shaped(seed: int = 0) -> np.ndarray:
    """[IMAGES, 4 + CLASSES, ANCHORS] like the built-in's: noise under the floor everywhere,
    objects each seen by a few neighbouring anchors (NMS keeps one), ties in score and in
    class; image 3 a crowd of 400 anchors over the floor; image 4 nothing."""
    rng = np.random.default_rng(seed)
    raw = np.zeros((IMAGES, 4 + CLASSES, ANCHORS), dtype=np.float32)
    raw[:, :2] = rng.uniform(0, 320, (IMAGES, 2, ANCHORS))
    raw[:, 2:4] = rng.uniform(4, 120, (IMAGES, 2, ANCHORS))
    raw[:, 4:] = rng.uniform(0, 0.2, (IMAGES, CLASSES, ANCHORS))
    for image in range(4):
        for _object in range(6 + 3 * image):
            anchor = int(rng.integers(0, ANCHORS - 8))
            cx, cy, w, h = rng.uniform(20, 300), rng.uniform(20, 300), *rng.uniform(10, 90, 2)
            cls, score = int(rng.integers(0, CLASSES)), float(rng.uniform(0.3, 0.95))
            for j in range(4):  # the same object from neighbouring anchors, a little off
                raw[image, :4, anchor + j] = (cx + j, cy - j, w, h)
                raw[image, 4 + cls, anchor + j] = score - 0.01 * j
            raw[image, 4 + (cls + 1) % CLASSES, anchor + 4] = score  # a tie: same score
            raw[image, :4, anchor + 4] = (cx + 40, cy, w, h)
    raw[1, 4 + 2, 7] = raw[1, 4 + 9, 7] = 0.7  # a tie between classes: the first wins
    raw[3, 4 + 5, 100:500] = rng.uniform(0.3, 0.9, 400).astype(np.float32)  # a crowd
    raw[4, 4:] = 0.0
    return raw


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, np.ndarray]:
    folder = tmp_path_factory.mktemp("detect-device")
    raw = real_shaped()
    np.save(folder / "raw.npy", raw)
    run_torch_child(CHILD, folder)
    fits = np.asarray([placement_row(f) for f in FITS], dtype=np.float32)
    return folder, raw, fits


def decoded(posted: np.ndarray, fits: np.ndarray) -> list[list[dict[str, object]]]:
    found = posted_candidates(posted, fits, SCORE_FLOOR)
    lists = detections(found, len(posted), iou_threshold=IOU)
    return [list(row.as_py()) for row in lists]


def expected(raw: np.ndarray) -> list[list[dict[str, object]]]:
    return [decode_yolo(raw[i], FITS[i], score_threshold=SCORE_FLOOR, iou_threshold=IOU)
            for i in range(len(raw))]  # fmt: skip


def test_the_device_candidates_give_decode_yolos_boxes(
    run: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    folder, raw, fits = run
    posted = np.load(folder / "posted.npy")
    assert posted.shape == (IMAGES, POSTED, 300) and posted.dtype == np.float32
    want = expected(raw)
    assert all(want[:4]) and want[4] == []  # boxes to find, and an image with none
    fewer = [0, 1, 2, 4]  # the crowd (3) has more anchors over the floor than 300: next test
    assert decoded(posted[fewer], fits[fewer]) == [want[i] for i in fewer]
    # best first, with the anchor and class each came from
    assert (np.diff(posted[:, SCORE], axis=1) <= 0).all()
    anchors = posted[:, ANCHOR].astype(np.int64)
    best = raw[:, 4:].max(axis=1)
    assert np.array_equal(np.take_along_axis(best, anchors, 1), posted[:, SCORE])
    assert posted[1, CLASS, list(anchors[1]).index(7)] == 2  # the first of two equal classes


def test_taken_whole_when_the_cut_left_some_out(run: tuple[Path, np.ndarray, np.ndarray]) -> None:
    """8 candidates an image leave out boxes; `cut_short` says so, and the whole take (every
    anchor) gives decode_yolo's boxes again."""
    folder, raw, fits = run
    short, whole = np.load(folder / "short.npy"), np.load(folder / "whole.npy")
    post = YoloCandidates("detector", CLASSES, SCORE_FLOOR, k=8)
    assert short.shape == (IMAGES, POSTED, 8) and post.cut_short(short)
    assert whole.shape == (IMAGES, POSTED, ANCHORS) and not post.cut_short(whole)
    assert decoded(whole, fits) == expected(raw)
    posted = np.load(folder / "posted.npy")  # 300: the crowd of image 3 is over it
    assert YoloCandidates("detector", CLASSES, SCORE_FLOOR).cut_short(posted)
    assert decoded(posted, fits)[3] != expected(raw)[3]  # what the whole take is for
    assert not YoloCandidates("detector", CLASSES, SCORE_FLOOR).cut_short(posted[:3])


def test_a_half_precision_output_keeps_its_anchor_indices(
    run: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    folder, _raw, _fits = run
    half = np.load(folder / "half.npy")
    assert half.dtype == np.float32
    anchors = half[:, ANCHOR]
    assert np.array_equal(anchors, np.round(anchors)) and anchors.max() > 2048


def test_a_wrong_shape_is_refused_on_the_device() -> None:
    post = YoloCandidates("boxes", 3, SCORE_FLOOR)
    with pytest.raises(ValueError, match=r"not \[N, 7, anchors\]"):
        post.on_device([np.zeros((2, 22, 10), dtype=np.float32)])
