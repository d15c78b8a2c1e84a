"""Torch calls counted per stage thread of the device stages (issue 38): streams that
push a counting `TorchFunctionMode` on a stage's thread for each of its steps, around the
streams they wrap. Imports torch: only a torch child process (tests/workers/device) or a GPU
test (tests/gpu) imports it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch.overrides import TorchFunctionMode

from kiln.workers.device.stages import CpuStreams, Streams, tensors_in


class Count(TorchFunctionMode):
    """Every torch call made while it is on this thread's stack: `calls` (attribute reads,
    which do not release the GIL, apart as `getters`), and each by its name (`call:stack`)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
        self.calls["getters" if name.endswith("__get__") else "calls"] += 1
        self.calls[f"call:{getattr(func, '__name__', name)}"] += 1
        return func(*args, **(kwargs or {}))


class CountingStreams:
    """`inner` streams (default: `CpuStreams`) that count each step's torch calls — on a GPU
    the hand-over's `record_stream` calls among them —, the tensors handed over to it and its
    thread's CPU microseconds (`cpu_us`), by stage (`steps`: one `Counter` per batch)."""

    def __init__(self, inner: Streams | None = None) -> None:
        self.inner: Streams = inner if inner is not None else CpuStreams()
        self.steps: dict[str, list[Counter[str]]] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def new(self) -> Any:
        return self.inner.new()

    @contextlib.contextmanager
    def using(self, stream: Any) -> Iterator[None]:
        mode = self._local.mode = Count()
        began = time.thread_time()
        with mode, self.inner.using(stream):
            yield
        mode.calls["cpu_us"] = round(1e6 * (time.thread_time() - began))
        stage = threading.current_thread().name.split("-")[-2]  # `{name}-{stage}-{n}`
        with self._lock:
            self.steps.setdefault(stage, []).append(mode.calls)

    def record(self, stream: Any) -> Any:
        return self.inner.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        self.inner.wait(stream, event)

    def hand_over(self, value: Any, stream: Any) -> None:
        self._local.mode.calls["handed"] += sum(1 for _ in tensors_in(value))
        self.inner.hand_over(value, stream)

    def settle(self, event: Any) -> None:
        self.inner.settle(event)


def per_batch(steps: list[Counter[str]]) -> dict[str, list[int]]:
    """Each counter's value in each batch's step (0 where a step had none)."""
    keys = sorted({key for step in steps for key in step})
    return {key: [step.get(key, 0) for step in steps] for key in keys}
