"""`KILN_MAX_BATCH=auto` on a GPU: the batch a model runs at, chosen when it loads.

A short sweep times the engine on synthetic input at 16, 32, 64, … up to what it was built
for (one caller, nothing else running). A batch that runs out of memory ends the sweep (the
memory budget caps it). An engine whose input has other dynamic sides (OCR's detector) keeps
its built size. What is taken from the sweep depends on what feeds the engine:

- **Fed by Batcher runners** (`knee`): the batch after which doubling no longer buys 10% more
  rows per second. A bigger batch only adds latency and memory; a smaller one leaves the GPU
  waiting on the host.
- **Fed by the device stages** (`for_device_stages`: decode → fit → forward → outputs, each
  stage on its own thread; `workers/device/`): the *largest* batch whose forward takes at most
  `LATENCY_S` and whose rows per second are within `WITHIN` of the best such batch. Why not
  the knee: the sweep sees the engine alone, but every batch also costs the device stages' host a
  fixed amount in each stage — a dozen torch calls, a hand-over between streams, a Batcher
  block, an answer — and in the engine's process each torch call waits ~0.25–0.3 ms for the
  GIL (issue 38; on the H200 the fit stage took 9–12 ms a batch of 32 before it was cut to a
  dozen calls). Past the knee the engine's rate is flat, so a bigger batch costs the GPU
  nothing while it halves those costs per row each time it doubles; the bound on the forward
  keeps a batch's trip through the device stages' ~13 batches in flight well under a second and
  its device memory (decoded and fitted images) small. The H200's ResNet-50 table (b16 1.84
  ms, b32 2.81, b64 5.59, b256 21.6: 8,696, 11,388, 11,449 and 11,852 rows/s): the knee is 32;
  for the device stages 256 is over the bound, 64 is the best of the rest and the largest within
  5% of it, so 64 (which is also where the engine fed by the host stages ran
  best: 12,685 rows/s, docs/gpu.md).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial

import numpy as np

from kiln.workers.batching import is_out_of_memory
from kiln.workers.engines.base import Engine, TensorSpec

log = logging.getLogger(__name__)

START = 16
GAIN = 1.10  # a doubling must give at least this much more throughput to be worth it
LATENCY_S = 0.010  # the device stages' batch: its forward at most this long
WITHIN = 0.05  # … and its rows per second at most this far below the best such batch
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


def for_device_stages(
    rates: Mapping[int, float], latency_s: float = LATENCY_S, within: float = WITHIN
) -> int:
    """The largest batch in `rates` (rows per second by batch) whose forward takes at most
    `latency_s` and whose rate is within `within` of the best such batch's; the smallest
    batch when every one is slower than that."""
    fast = {b: r for b, r in rates.items() if b / r <= latency_s} or {min(rates): 0.0}
    best = max(fast.values())
    return max(b for b, r in fast.items() if r >= best * (1 - within))


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
    """Rows per second of `run` at its median call (one warm-up call, then as many as fit in
    `seconds`). The median, not the mean: a call the host preempted says nothing about the
    engine, and on a busy host the mean moved the chosen batch from run to run."""
    run()
    took: list[float] = []
    started = time.perf_counter()
    while (now := time.perf_counter()) - started < seconds or not took:
        run()
        took.append(time.perf_counter() - now)
    return batch / max(statistics.median(took), 1e-9)


def choose_batch(
    engine: Engine, cap: int, name: str = "", seconds: float = SWEEP_S, *, staged: bool = False
) -> int:
    """The batch between 16 and `cap` for `engine`: its knee, or for an engine the device
    stages feed (`staged`) the batch `for_device_stages` takes."""
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
    chosen = for_device_stages(rates) if staged else knee(rates)
    shown = ", ".join(f"{b}: {r:.0f}/s, {1e3 * b / r:.2f} ms" for b, r in rates.items())
    rule = "for its device stages" if staged else "at the knee"
    log.info("model %s: batch %d chosen %s (%s)", name, chosen, rule, shown,
             extra={"max_batch": chosen})  # fmt: skip
    return chosen
