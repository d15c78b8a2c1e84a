"""CUDA graphs for fixed-shape engines: one graph per batch bucket, replayed.

A ResNet-50 batch of 16 is ~160 kernel launches; launched one by one from Python the GPU waits
on the host between them (measured in docs/gpu.md). So each
batch size is rounded up to a bucket — the powers of two up to the model's batch — and each
bucket's forward pass is captured once and replayed: the rows past the batch are padding,
computed and never read.

A captured graph reads and writes fixed device tensors, so two runner threads must not replay
the same one at once: each runner borrows a `GraphSet` (its graphs and their memory pool) for
the length of a batch. A set's graphs share one pool — safe because they never run at the same
time, and each batch's outputs are copied out before the set is lent again (waited for on the
host by a runner; by a staged forward, queued, with an event the next borrower's stream waits
for: `GraphSet.released`).

The capture itself is a parameter (`Capture`): `cuda_capture` on a GPU, an eager stand-in in
the tests, so bucketing, padding and lending are tested on the CPU.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

Forward = Callable[[list[Any]], list[Any]]  # device input tensors -> device output tensors
MakeInputs = Callable[[int], list[Any]]  # rows -> static input tensors with that many rows
WARM_UP_CALLS = 3  # eager runs before capture: cuDNN picks its algorithms, allocations settle


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, … below `max_batch`, then `max_batch` itself."""
    found = [1 << i for i in range(max(1, max_batch).bit_length()) if 1 << i < max_batch]
    return [*found, max(1, max_batch)]


def bucket_for(rows: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `rows` (the sizes are ascending)."""
    for size in sizes:
        if size >= rows:
            return size
    raise ValueError(f"A batch of {rows} rows is larger than the largest bucket ({sizes[-1]}).")


class Captured(Protocol):
    """One bucket's graph: fill `inputs` (static, `rows` rows each), `replay`, read `outputs`."""

    inputs: list[Any]
    outputs: list[Any]

    def replay(self) -> None: ...


# (forward, static inputs, memory pool) -> the captured graph
Capture = Callable[[Forward, list[Any], Any], Captured]


class GraphSet:
    """One runner's graphs, a bucket each, captured on first use and sharing `pool`."""

    def __init__(self, capture: Capture, forward: Forward, inputs: MakeInputs, pool: Any) -> None:
        self._capture = capture
        self._forward = forward
        self._inputs = inputs
        self.pool = pool
        self.graphs: dict[int, Captured] = {}
        # A CUDA event after the last use queued on it (None: nothing queued, or waited for
        # already): a staged forward lends the set back before its replay and copies have run,
        # so a borrower on another stream waits for this before it writes the static inputs.
        self.released: Any = None

    def get(self, bucket: int) -> Captured:
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(
                self._forward, self._inputs(bucket), self.pool
            )
        return graph


class Graphs:
    """The sets lent to runner threads, one batch at a time; `close` drops every graph (and
    with them their memory) before the model's own memory goes."""

    def __init__(self, sets: list[GraphSet], max_batch: int) -> None:
        self.sizes = buckets(max_batch)
        self._free: queue.SimpleQueue[GraphSet] = queue.SimpleQueue()
        self._sets = sets
        for graph_set in sets:
            self._free.put(graph_set)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lend(self) -> Iterator[GraphSet]:
        graph_set = self._free.get()  # more runners than sets: the extra one waits its turn
        try:
            yield graph_set
        finally:
            self._free.put(graph_set)

    @property
    def sets(self) -> list[GraphSet]:
        return list(self._sets)

    def captured(self) -> dict[int, int]:
        """bucket → how many sets hold it (for logs and tests)."""
        counts: dict[int, int] = {}
        for graph_set in self._sets:
            for bucket in graph_set.graphs:
                counts[bucket] = counts.get(bucket, 0) + 1
        return counts

    def close(self) -> None:
        with self._lock:
            for graph_set in self._sets:
                graph_set.graphs.clear()
            self._sets.clear()


# --- on a GPU -----------------------------------------------------------------------------


@dataclass
class CudaCaptured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: list[Any]
    outputs: list[Any]

    def replay(self) -> None:
        self.graph.replay()  # on the caller's current stream


def cuda_capture(torch: Any, device: Any) -> Capture:
    """Capture with torch.cuda.graph after a few eager calls on a side stream (what PyTorch's
    documentation asks: warm-up must not run on the stream being captured)."""

    def capture(forward: Forward, inputs: list[Any], pool: Any) -> Captured:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARM_UP_CALLS):
                forward(inputs)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another runner's copies and waits, in its own thread, stay legal
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = forward(inputs)
        return CudaCaptured(graph, inputs, list(outputs))

    return capture


def cuda_pool(torch: Any) -> Any:
    return torch.cuda.graph_pool_handle()
