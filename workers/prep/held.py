"""Bytes a prep process keeps from a read-only unit (the content cache is asked before anything
decodes) for the unit that prepares the same items after it: by item id, oldest let go first.
Each is kept with its SHA-256, taken when it was read: the prepare does not hash it again."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

HELD_BYTES = 128 * 2**20  # bytes of read-only units kept for their prepare, at most


class Held(NamedTuple):
    """An item's bytes as its read-only unit read them, and their SHA-256 (hex)."""

    data: bytes
    sha256: str


class HeldBytes:
    """Item id → its bytes and their hash, at most HELD_BYTES of bytes (always the newest
    item's); an item let go is fetched (and hashed) again by its prepare."""

    def __init__(self) -> None:
        self._bytes: OrderedDict[int, Held] = OrderedDict()
        self._total = 0

    def hold(self, item: int, data: bytes, sha256: str) -> None:
        self.forget(item)
        self._bytes[item] = Held(data, sha256)
        self._total += len(data)
        while self._total > HELD_BYTES and len(self._bytes) > 1:
            _, old = self._bytes.popitem(last=False)
            self._total -= len(old.data)

    def take(self, item: int) -> Held | None:
        """The item's bytes and hash, no longer held (its prepare has them now), or None."""
        held = self._bytes.pop(item, None)
        if held is not None:
            self._total -= len(held.data)
        return held

    def forget(self, item: int) -> None:
        self.take(item)
