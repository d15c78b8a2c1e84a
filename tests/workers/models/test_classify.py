"""The classifier's softmax, top-k and refusal floor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from devstack.images import solid
from kiln.app.core.errors import InputError
from kiln.workers.engines.onnxruntime import OnnxRuntimeEngine
from kiln.workers.models.base import Refusal, names_of, null_mask, numeric
from kiln.workers.models.classify import (
    ARGMAX_K,
    ClassifyPredictor,
    label_lists,
    shifted_exp,
    softmax,
    take_top_k,
    top_k,
    top_k_indices,
)
from kiln.workers.models.direct import run_direct
from tests.models import colour_classifier
from tests.workers.models.halves import outputs


def test_softmax_sums_to_one() -> None:
    logits = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)
    probabilities = softmax(logits)
    assert probabilities.shape == (4, 10)
    np.testing.assert_allclose(probabilities.sum(axis=-1), 1.0, rtol=1e-6)
    assert (probabilities > 0).all()
    assert (probabilities.argmax(axis=-1) == logits.argmax(axis=-1)).all()


def test_softmax_of_a_single_vector() -> None:
    probabilities = softmax(np.array([0.0, np.log(3.0)]))
    np.testing.assert_allclose(probabilities, [0.25, 0.75])


@pytest.mark.parametrize("offset", [1000.0, -1000.0, 1e6])
def test_softmax_is_stable_for_large_logits(offset: float) -> None:
    # With pytest's warnings-as-errors, an overflow in exp would fail the test too.
    logits = np.array([[0.0, 1.0, 2.0]]) + offset
    probabilities = softmax(logits)
    assert np.isfinite(probabilities).all()
    np.testing.assert_allclose(probabilities, softmax(np.array([[0.0, 1.0, 2.0]])), rtol=1e-6)
    np.testing.assert_allclose(probabilities.sum(), 1.0)


def test_softmax_float32_large_logits() -> None:
    probabilities = softmax(np.array([1000.0, 1000.0], dtype=np.float32))
    np.testing.assert_allclose(probabilities, [0.5, 0.5])


LABELS = ["cat", "dog", "fish", "bird"]


def test_top_k_order_and_labels() -> None:
    probabilities = np.array([0.1, 0.6, 0.05, 0.25])
    assert top_k(probabilities, LABELS, 2) == [
        {"label": "dog", "score": 0.6},
        {"label": "bird", "score": 0.25},
    ]


def test_top_k_larger_than_the_number_of_classes() -> None:
    probabilities = np.array([0.1, 0.6, 0.05, 0.25])
    result = top_k(probabilities, LABELS, 10)
    assert [r["label"] for r in result] == ["dog", "bird", "cat", "fish"]


def test_top_k_ties_keep_class_order() -> None:
    probabilities = np.array([0.25, 0.25, 0.25, 0.25])
    assert [r["label"] for r in top_k(probabilities, LABELS, 3)] == ["cat", "dog", "fish"]


def test_top_k_without_enough_labels_uses_the_index() -> None:
    probabilities = np.array([0.1, 0.2, 0.7])
    assert top_k(probabilities, ["a"], 3) == [
        {"label": "2", "score": 0.7},
        {"label": "1", "score": 0.2},
        {"label": "a", "score": 0.1},
    ]


@pytest.mark.parametrize("k", [0, 1, 5, ARGMAX_K, ARGMAX_K + 1, 40])
def test_the_top_k_taken_from_the_exps_are_softmaxs_top_k(k: int) -> None:
    """The batch path (top k of exp(logit - max), k scores divided) answers as the softmax
    and its sorted top k do: the same classes in the same order, ties to the lower index
    (a row of equal logits, a row of rounded ones), and the very same scores."""
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((6, 40)) * 3).astype(np.float32)
    logits[0] = 0  # a row that failed to decode: every class tied
    logits[1] = np.round(logits[1])  # ties across the k-th place
    probabilities = softmax(logits)
    exp, total = shifted_exp(logits)
    best, taken = take_top_k(exp, k)
    assert np.array_equal(best, top_k_indices(probabilities, k))
    scores = taken / total[:, np.newaxis]
    assert np.array_equal(scores, np.take_along_axis(probabilities, best, axis=1))
    assert np.array_equal(1 / total, probabilities.max(axis=1))  # the top score


def test_names_of_picks_labels_and_numbers_past_them() -> None:
    names = names_of(["cat", "dog"], np.array([1, 3, 0, 1]))
    assert names.type == pa.string()
    assert names.to_pylist() == ["dog", "3", "cat", "dog"]
    assert names_of(["cat"], np.array([], dtype=np.int64)).to_pylist() == []


def test_numeric_arrays_share_numpys_values_in_the_width_asked() -> None:
    grid = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert numeric(grid.T).to_pylist() == [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]  # any layout, flattened
    offsets = numeric(np.array([0, 5, 10]), pa.int32())
    assert offsets.type == pa.int32() and offsets.to_pylist() == [0, 5, 10]
    halves = numeric(np.array([0.5, 1.5], dtype=np.float16))
    assert halves.type == pa.float16() and halves.null_count == 0
    assert numeric(np.array([True, False, True])).to_pylist() == [True, False, True]


def test_a_batch_with_no_refusal_has_no_null_mask() -> None:
    assert null_mask(None) is None
    assert null_mask(np.zeros(4, dtype=bool)) is None
    assert null_mask(np.array([False, True])).to_pylist() == [False, True]


def test_label_lists_are_null_only_where_refused() -> None:
    probabilities = softmax(np.array([[1.0, 2.0, 0.5], [3.0, 0.0, 0.0]], dtype=np.float32))
    kept = label_lists(probabilities, ["a", "b", "c"], 2, np.array([False, False]))
    assert kept.null_count == 0
    assert [[e["label"] for e in row] for row in kept.to_pylist()] == [["b", "a"], ["a", "b"]]
    refused = label_lists(probabilities, ["a", "b", "c"], 2, np.array([True, False]))
    assert refused.to_pylist()[0] is None
    assert refused.to_pylist()[1] == kept.to_pylist()[1]


def test_top_k_scores_are_rounded_plain_floats() -> None:
    probabilities = softmax(np.array([0.3, 1.7, -0.4], dtype=np.float32))
    result = top_k(probabilities, ["a", "b", "c"], 1)
    assert type(result[0]["score"]) is float
    assert result[0]["score"] == round(float(probabilities[1]), 6)


def test_a_large_jpeg_is_drafted_to_the_resize_side_not_further() -> None:
    """A 2048×1536 JPEG decodes at 1/4 scale (512×384) for a 224 crop of a 256 resize: far
    cheaper than a full decode, and the crop matches the full decode's closely."""
    from PIL import Image

    from devstack.images import photo
    from kiln.workers.prep.pixels import center_crop, decode_image, resize_side

    data = photo(3, size=(2048, 1536))
    drafted = decode_image(data, max_pixels=50_000_000, draft_to=resize_side(224))
    full = decode_image(data, max_pixels=50_000_000)
    assert drafted.image.size == (512, 384)
    assert (drafted.width, drafted.height) == (2048, 1536)
    assert min(drafted.image.size) >= resize_side(224)
    a = center_crop(drafted, 224).astype(np.float32)
    b = center_crop(full, 224).astype(np.float32)
    assert a.shape == b.shape == (224, 224, 3)
    assert np.abs(a - b).mean() < 4.0  # of 255: the same picture
    assert isinstance(full.image, Image.Image)


# --- refusals: a top score below the spec's floor is "no answer" ----------------------------


def colours(tmp_path: Path, **spec: Any) -> ClassifyPredictor:
    colour_classifier(tmp_path / "c.onnx")
    engine = OnnxRuntimeEngine(tmp_path / "c.onnx", max_batch=4)
    declared = {"input_size": 32, "labels": ["red", "green", "blue", "dark"], "top_k": 2,
                "mean": [0, 0, 0], "std": [1, 1, 1], **spec}  # fmt: skip
    return ClassifyPredictor("colours:1", engine, declared, max_pixels=1 << 24)


def answer(predictor: ClassifyPredictor, data: bytes) -> dict[str, Any]:
    (found,) = outputs(predictor, [data])
    return found


def test_a_score_below_the_floor_is_a_refusal(tmp_path: Path) -> None:
    predictor = colours(tmp_path, refuse_below=0.5)
    assert answer(predictor, solid((250, 5, 5)))["labels"][0]["label"] == "red"
    with pytest.raises(Refusal) as refusal:
        answer(predictor, solid((128, 128, 128)))  # red, green and blue alike: a third each
    assert str(refusal.value) == "Refused: the top score 0.3333 is below the model's floor 0.5."
    assert isinstance(refusal.value, InputError)  # without a fallback, the item fails with it
    red, grey = run_direct(predictor, [solid((250, 5, 5)), solid((128, 128, 128))])
    assert isinstance(red, dict) and red["labels"][0]["label"] == "red"  # in the same batch
    assert isinstance(grey, Refusal) and str(grey) == str(refusal.value)


def test_without_a_floor_every_answer_stands(tmp_path: Path) -> None:
    labels = answer(colours(tmp_path), solid((128, 128, 128)))["labels"]
    assert labels[0]["score"] == pytest.approx(1 / 3, abs=1e-3)
