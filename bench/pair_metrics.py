"""How well predicted groups match the true ones, counted over pairs of items.

A pair is *true* when both items come from the same original, *predicted* when both are in the
same predicted group; precision is the share of predicted pairs that are true, recall the
share of true pairs predicted. Counted from the table of (predicted group, true group) sizes,
so a predicted group of thousands costs no more than a small one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PairScores:
    true_pairs: int
    predicted_pairs: int
    correct_pairs: int

    @property
    def precision(self) -> float | None:
        """None when nothing was grouped: no predicted pair to be right or wrong."""
        return self.correct_pairs / self.predicted_pairs if self.predicted_pairs else None

    @property
    def recall(self) -> float | None:
        return self.correct_pairs / self.true_pairs if self.true_pairs else None


def _pairs(size: int) -> int:
    return size * (size - 1) // 2


def pair_scores(truth: Sequence[Hashable], predicted: Sequence[Hashable]) -> PairScores:
    """`truth[i]` and `predicted[i]` are item i's true and predicted group labels (an item
    alone in either has a label no other item has)."""
    if len(truth) != len(predicted):
        raise ValueError(f"{len(truth)} true labels but {len(predicted)} predicted ones.")
    both = Counter(zip(truth, predicted, strict=True))
    return PairScores(
        true_pairs=sum(_pairs(n) for n in Counter(truth).values()),
        predicted_pairs=sum(_pairs(n) for n in Counter(predicted).values()),
        correct_pairs=sum(_pairs(n) for n in both.values()),
    )


def group_labels(keys: Sequence[str], groups: Sequence[Sequence[str]]) -> list[int]:
    """Each key's predicted group as a number: its group's index, or for a key in no group
    (grouping leaves singletons out) a number of its own."""
    group_of = {key: number for number, group in enumerate(groups) for key in group}
    alone = len(groups)
    labels = []
    for key in keys:
        if key in group_of:
            labels.append(group_of[key])
        else:
            labels.append(alone)
            alone += 1
    return labels


def found_with_original(
    sources: Sequence[int], transforms: Sequence[str], predicted: Sequence[int]
) -> dict[str, float]:
    """Per transformation, the share of copies in the same predicted group as their original
    (`transforms[i]` is "original" for an original; other items with no copy name are
    distractors and not counted)."""
    original = {
        s: p for s, t, p in zip(sources, transforms, predicted, strict=True) if t == "original"
    }
    found: Counter[str] = Counter()
    total: Counter[str] = Counter()
    for source, transform, label in zip(sources, transforms, predicted, strict=True):
        if transform in ("original", "distractor"):
            continue
        total[transform] += 1
        found[transform] += original.get(source) == label
    return {name: found[name] / total[name] for name in total}


def direct_precision(truth: Sequence[Hashable], pairs: np.ndarray) -> float | None:
    """The share of `pairs` ([m, 2] item indices: the pairs a threshold admits, before they
    are joined into groups) whose items are truly alike; None for no pair."""
    if not len(pairs):
        return None
    labels = np.asarray(truth)
    return float(np.mean(labels[pairs[:, 0]] == labels[pairs[:, 1]]))
