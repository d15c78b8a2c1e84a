"""A loaded model's heap is frozen out of the cycle collector's passes, and thawed when a
model unloads, so what the unloaded one left in cycles can still be collected."""

from __future__ import annotations

import gc

from kiln.workers.runners.runners import _freeze_heap, _return_device_memory


def test_a_load_freezes_the_heap_and_an_unload_thaws_it() -> None:
    made: list[list[int]] = [[] for _ in range(100)]  # objects alive at the load: a model's, say
    try:
        _freeze_heap()
        assert gc.get_freeze_count() >= len(made)
        _return_device_memory()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
