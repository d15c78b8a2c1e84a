"""Bytes a prep process keeps from a read-only unit (the content cache is asked before anything
decodes) for the unit that prepares the same items after it: by item id, oldest let go first."""

from __future__ import annotations

from collections import OrderedDict

HELD_BYTES = 128 * 2**20  # bytes of read-only units kept for their prepare, at most


class HeldBytes:
    """Item id → its bytes, at most HELD_BYTES of them (always the newest item's); an item let
    go is fetched again by its prepare."""

    def __init__(self) -> None:
        self._bytes: OrderedDict[int, bytes] = OrderedDict()
        self._total = 0

    def hold(self, item: int, data: bytes) -> None:
        self.forget(item)
        self._bytes[item] = data
        self._total += len(data)
        while self._total > HELD_BYTES and len(self._bytes) > 1:
            _, old = self._bytes.popitem(last=False)
            self._total -= len(old)

    def take(self, item: int) -> bytes | None:
        """The item's bytes, no longer held (its prepare has them now), or None."""
        data = self._bytes.pop(item, None)
        if data is not None:
            self._total -= len(data)
        return data

    def forget(self, item: int) -> None:
        self.take(item)
