"""Issue 17's grouping-quality bench: pair precision and recall on hand-made groups, and the
generated set's labels. Pure functions and a few small images; no services, no timing."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from bench.grouping import cosine_lines, hamming_pairs, hash_all, markdown
from bench.near_duplicates import TRANSFORMS, Item, labelled_set
from bench.pair_metrics import direct_precision, found_with_original, group_labels, pair_scores


def test_pair_scores_count_pairs_inside_groups() -> None:
    # Truth: items 0-2 are one picture, 3-4 another, 5 stands alone (4 true pairs).
    truth = ["a", "a", "a", "b", "b", "c"]
    # Predicted: {0, 1} and {2, 3, 4}; 5 alone. Pairs (0,1) and (3,4) are right, (2,3), (2,4)
    # wrong, and (0,2), (1,2) are missed.
    scores = pair_scores(truth, [0, 0, 1, 1, 1, 2])
    assert (scores.true_pairs, scores.predicted_pairs, scores.correct_pairs) == (4, 4, 2)
    assert scores.precision == 0.5 and scores.recall == 0.5


def test_perfect_none_and_everything_grouped() -> None:
    truth = [1, 1, 2, 2, 3]
    perfect = pair_scores(truth, [7, 7, 8, 8, 9])
    assert perfect.precision == 1.0 and perfect.recall == 1.0
    nothing = pair_scores(truth, [0, 1, 2, 3, 4])
    assert nothing.precision is None and nothing.recall == 0.0
    everything = pair_scores(truth, [0] * 5)
    assert everything.precision == pytest.approx(2 / 10) and everything.recall == 1.0
    with pytest.raises(ValueError, match="5 true labels but 4"):
        pair_scores(truth, [0, 0, 0, 0])


def test_direct_precision_scores_pairs_before_they_are_joined() -> None:
    truth = ["a", "a", "b", "b", "c"]
    # (0,1) and (2,3) are right; (1,2) is wrong, and would join all four in a group.
    assert direct_precision(truth, np.array([[0, 1], [1, 2], [2, 3]])) == pytest.approx(2 / 3)
    assert direct_precision(truth, np.empty((0, 2), np.int64)) is None


def test_hamming_pairs_are_every_pair_within_the_distance() -> None:
    bits = np.array([0b0, 0b111, 0b1, 0b1111_0000], np.uint64)
    np.testing.assert_array_equal(hamming_pairs(bits, 1, block=3), [[0, 2]])
    np.testing.assert_array_equal(hamming_pairs(bits, 3, block=3), [[0, 1], [0, 2], [1, 2]])
    assert hamming_pairs(bits[:0], 3).shape == (0, 2)


def test_keys_in_no_group_get_labels_of_their_own() -> None:
    labels = group_labels(["a", "b", "c", "d", "e"], [["b", "d"], ["e", "a"]])
    assert labels[1] == labels[3] == 0 and labels[0] == labels[4] == 1
    assert labels[2] not in (0, 1)
    assert len(set(group_labels(["x", "y", "z"], []))) == 3


def test_copies_count_as_found_only_beside_their_original() -> None:
    sources = [0, 0, 0, 1, 1, 1, 2]
    transforms = ["original", "crop", "jpeg", "original", "crop", "jpeg", "distractor"]
    predicted = [5, 5, 6, 7, 8, 8, 5]  # copy 1-jpeg is with its sibling, not its original
    found = found_with_original(sources, transforms, predicted)
    assert found == {"crop": 0.5, "jpeg": 0.0}


def test_the_set_labels_every_copy_with_its_original() -> None:
    items = labelled_set(originals=2, distractors=1)
    assert len(items) == 2 * (1 + len(TRANSFORMS)) + 1
    assert len({i.key for i in items}) == len(items)
    for seed in (0, 1):
        made = [i for i in items if i.source == seed]
        assert [i.transform for i in made] == ["original", *TRANSFORMS]
        assert all(i.is_copy for i in made[1:]) and not made[0].is_copy
    (distractor,) = [i for i in items if i.transform == "distractor"]
    assert distractor.source == 2 and not distractor.is_copy
    sizes = {i.transform: Image.open(io.BytesIO(i.data)).size for i in items if i.source == 0}
    assert sizes["original"] == (640, 480)
    assert sizes["resize-0.5"] == (320, 240)
    assert sizes["crop-90-centre"] == (576, 432)
    assert sizes["crop-80-offset"] == (512, 384)


def test_copies_hash_near_their_original_and_pictures_far_apart() -> None:
    items = labelled_set(originals=2, distractors=2)
    hashes = dict(zip((i.key for i in items), hash_all([i.data for i in items]), strict=True))

    def bits(a: str, b: str) -> int:
        return (int(hashes[a], 16) ^ int(hashes[b], 16)).bit_count()

    assert bits("00000-original", "00000-resize-0.75") <= 8
    pictures = [i.key for i in items if not i.is_copy]
    assert min(bits(a, b) for a in pictures for b in pictures if a < b) > 12


def test_cosine_lines_score_exact_groups_at_each_threshold() -> None:
    # Two originals with one copy each and a distractor, as vectors: each copy at cosine 0.96
    # to its original, the two originals at 0.8.
    items = [
        Item("o0", 0, "original", b""),
        Item("c0", 0, "crop", b""),
        Item("o1", 1, "original", b""),
        Item("c1", 1, "crop", b""),
        Item("d", 2, "distractor", b""),
    ]
    vectors = np.array(
        [[1, 0, 0], [0.96, 0.28, 0], [0.8, 0, 0.6], [0.8, -0.28, 0.53], [0, 1, 0]], np.float32
    )
    strict, loose = cosine_lines(items, vectors, [0.95, 0.75])
    assert (strict.scores.precision, strict.scores.recall) == (1.0, 1.0)
    assert strict.found == {"crop": 1.0} and (strict.groups, strict.largest) == (2, 2)
    assert loose.groups == 1 and loose.largest == 4
    assert loose.scores.precision == pytest.approx(2 / 6) and loose.scores.recall == 1.0
    # At 0.75 five pairs pass directly: o0-c0 and o1-c1 right; o0-o1, o0-c1 and o1-c0 wrong.
    assert loose.direct == pytest.approx(2 / 5) and strict.direct == 1.0
    assert "≥ 0.95" in markdown([strict]) and "(default)" not in markdown([strict])
