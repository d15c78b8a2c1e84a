"""Bytes a prep process keeps from a read-only unit for the unit that prepares them."""

from __future__ import annotations

from kiln.workers.prep.held import HELD_BYTES, Held, HeldBytes


def test_held_bytes_keep_the_newest_within_the_bound() -> None:
    held = HeldBytes()
    half = b"x" * (HELD_BYTES // 2 + 1)
    held.hold(1, half, "h1")
    held.hold(2, half, "h2")  # over the bound: the oldest goes
    assert held.take(1) is None
    assert held.take(2) == Held(half, "h2")  # with the hash taken when it was read
    assert held.take(2) is None  # taken once
    held.hold(3, b"y" * (HELD_BYTES + 1), "h3")  # alone over the bound: kept all the same
    held.forget(3)
    assert held.take(3) is None
