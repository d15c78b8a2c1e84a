"""`KILN_MAX_BATCH=auto` on a GPU: the batch a model runs at, chosen when it loads.

A short sweep times the engine on synthetic input at 16, 32, 64, … up to what it was built
for, and takes the knee: the batch after which doubling no longer buys 10% more rows per
second. A bigger batch than the knee only adds latency and memory; a smaller one leaves the
GPU waiting on the host. A batch that runs out of memory ends the sweep (the memory budget
caps it). An engine whose input has other dynamic sides (OCR's detector) keeps its built size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from kiln.workers.batching import is_out_of_memory
from kiln.workers.engines.base import Engine, TensorSpec

log = logging.getLogger(__name__)

START = 16
GAIN = 1.10  # a doubling must give at least this much more throughput to be worth it
SWEEP_S = 0.25  # timed per size, after one warm-up call
SEQUENCE = 128  # a text model's sequence length in the sweep


def knee(rates: Mapping[int, float], gain: float = GAIN) -> int:
    """The smallest batch after which the next size in `rates` gains less than `gain`."""
    sizes = sorted(rates)
    best = sizes[0]
    for size in sizes[1:]:
        if rates[size] < rates[best] * gain:
            break
        best = size
    return best


def sizes(cap: int, start: int = START) -> list[int]:
    """16, 32, … up to `cap` (and `cap` itself when it is not a power of two)."""
    found = [s for s in (start * 2**i for i in range(16)) if s < cap]
    return [*found, cap] if cap >= 1 else [1]


def synthetic(spec: TensorSpec, batch: int) -> np.ndarray | None:
    """Zeros in the input's shape with `batch` rows; None if another side is dynamic and not a
    sequence (an image of any size: nothing honest to time)."""
    dims: list[int] = [batch]
    for i, dim in enumerate(spec.shape[1:], start=1):
        if isinstance(dim, int) and dim > 0:
            dims.append(dim)
        elif len(spec.shape) == 2 and i == 1:
            dims.append(SEQUENCE)
        else:
            return None
    return np.zeros(dims, dtype=spec.dtype)


def rate(run: Callable[[], object], batch: int, seconds: float = SWEEP_S) -> float:
    """Rows per second of `run` (one warm-up call, then as many as fit in `seconds`)."""
    run()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds or calls == 0:
        run()
        calls += 1
    return batch * calls / (time.perf_counter() - started)


def choose_batch(engine: Engine, cap: int, name: str = "", seconds: float = SWEEP_S) -> int:
    """The knee of `engine`'s throughput between 16 and `cap`."""
    rates: dict[int, float] = {}
    for batch in sizes(cap):
        made = {spec.name: synthetic(spec, batch) for spec in engine.inputs}
        feeds = {name: x for name, x in made.items() if x is not None}
        if len(feeds) != len(made):
            return cap
        try:
            rates[batch] = rate(partial(engine.infer, feeds), batch, seconds)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            log.info("model %s: a batch of %d ran out of memory in the sweep", name, batch)
            break
    if not rates:
        return min(cap, START)
    chosen = knee(rates)
    shown = ", ".join(f"{b}: {r:.0f}/s" for b, r in rates.items())
    log.info("model %s: batch %d chosen (%s)", name, chosen, shown, extra={"max_batch": chosen})
    return chosen
