"""The GPU JPEG decoders' shared fallback: a batched decoder gives no partial results, so a
refused batch is decoded item by item, and an item refused alone comes back None (the CPU
then decodes it, or says why not). Pure: no torch, no GPU."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kiln.workers.device.decoders import batch_or_alone


class Refuses:
    """A batched decoder that refuses any batch holding a "bad" item."""

    def __init__(self, error: type[Exception] = RuntimeError) -> None:
        self.calls: list[list[str]] = []
        self.error = error

    def __call__(self, items: list[str]) -> Sequence[str]:
        self.calls.append(items)
        if "bad" in items:
            raise self.error("nvjpegDecode failed")
        return [item.upper() for item in items]


def test_a_good_batch_is_one_call() -> None:
    decode = Refuses()
    assert batch_or_alone(decode, ["a", "b"], (RuntimeError,)) == ["A", "B"]
    assert decode.calls == [["a", "b"]]


def test_a_refused_batch_goes_item_by_item_and_the_refused_item_is_none() -> None:
    decode = Refuses()
    assert batch_or_alone(decode, ["a", "bad", "c"], (RuntimeError,)) == ["A", None, "C"]
    assert decode.calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]]


def test_an_error_not_named_is_not_taken_for_a_refusal() -> None:
    with pytest.raises(KeyError):
        batch_or_alone(Refuses(KeyError), ["bad"], (RuntimeError,))
