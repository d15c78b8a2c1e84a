"""The device stages: each batch goes through stages (decode → fit → forward → outputs)
joined by bounded queues, each stage on its own thread(s) and its own CUDA stream, with an
event between one stage's device work and the next's, so batch N+1 decodes while N runs
forward and N−1's outputs come back.

Why stages and not more of the same runner: a runner that decodes, fits, runs and waits for
its outputs in turn leaves the GPU idle while it does host work and its host idle while it
waits (issue 33: 26% busy). Here each stage's host work overlaps the others' device work, the
device work of different batches overlaps on different streams, and only the last stage waits
on the host (for its own copy back). Queues hold `depth` batches between stages: enough that a
stage never starves while the one before it is busy, few enough to bound device memory.

What a batch carries between stages is in two places (`Work`): `values`, device memory, each
value a tensor or a list, tuple or dict of them, handed over to every later stage's stream
(`Streams.hand_over`: torch's `record_stream`, so the caching allocator does not reuse a block
that stream still reads); and `host`, everything else (row counts, failures, metas), never
walked. A stage hands on per batch, not per row — one stacked tensor per size group, not one
per image — because every torch call releases the GIL, and in the engine's process each
release costs a quarter of a millisecond of waiting for it back (issue 38).

A stage runs under `torch.cuda.stream(its stream)` only: never under a `torch.device` context,
which would put a Python `__torch_function__` on each of its torch calls; its tensors are made
with an explicit `device=`, or beside the tensors they come from.

`Streams` is the only CUDA here: `CpuStreams` (no streams, no events) runs the same stages
on the CPU in the tests, with stand-in stages.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)

DEPTH = 2  # batches waiting between two stages


class Streams(Protocol):
    """Streams and events of one device, or nothing on the CPU."""

    def new(self) -> Any: ...

    def using(self, stream: Any) -> contextlib.AbstractContextManager[None]: ...

    def record(self, stream: Any) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def hand_over(self, value: Any, stream: Any) -> None:
        """`stream` will read the tensors in `value` (a work's `values`: made on another
        stage's stream)."""
        ...

    def settle(self, event: Any) -> None:
        """Wait on the host until `event`'s device work is done."""
        ...


class CpuStreams:
    """The CPU: work is done when its call returns, so there is nothing to order."""

    def new(self) -> Any:
        return None

    def using(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def hand_over(self, value: Any, stream: Any) -> None:
        return None

    def settle(self, event: Any) -> None:
        return None


class CudaStreams:
    """One CUDA device's streams (torch's), events between them, and `record_stream` for the
    tensors one stage leaves to the next."""

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self._device = torch.device(device)

    def new(self) -> Any:
        return self._torch.cuda.Stream(device=self._device)

    def using(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        # the stream only (it makes its device the current one): a `torch.device` context
        # would run Python on each torch call of the stage
        context: contextlib.AbstractContextManager[None] = self._torch.cuda.stream(stream)
        return context

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def hand_over(self, value: Any, stream: Any) -> None:
        # one call per tensor, through this method (a stand-in device counts them here)
        if isinstance(value, (list, tuple)):
            for item in value:
                self.hand_over(item, stream)
        elif isinstance(value, dict):
            for item in value.values():
                self.hand_over(item, stream)
        elif getattr(value, "is_cuda", False):
            value.record_stream(stream)

    def settle(self, event: Any) -> None:
        if event is not None:
            event.synchronize()


def tensors_in(value: Any) -> Iterator[Any]:
    """The tensors in a `Work.values` entry: a tensor, or lists, tuples, dicts of them (a
    value of another type is not device memory, and is skipped)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif hasattr(value, "record_stream"):
        yield value


@dataclass
class Work:
    """One batch on its way: what it came with, what each stage leaves for the next — on the
    device (`values`: handed over to each later stage's stream) and on the host (`host`) —,
    its device work so far (`event`, on the last stage's stream), its answer."""

    payload: Any
    future: Future[Any] = field(default_factory=Future)
    values: dict[str, Any] = field(default_factory=dict)
    host: dict[str, Any] = field(default_factory=dict)
    event: Any = None
    result: Any = None


@dataclass(frozen=True)
class Stage:
    """A step of the trip: `run` reads and writes the work's values on this stage's stream
    (the last stage sets `result`); `threads` run it at once (a decoder whose state is per
    thread may have several)."""

    name: str
    run: Callable[[Work], None]
    threads: int = 1


@dataclass
class StageStats:
    """A stage's totals: batches done, seconds running them, seconds waiting for a batch
    (starved: the stage before was the slower, or the device stages were empty), seconds waiting to
    hand one on (blocked: the stage after was). The last stage first waits on the host for the
    device work before it (`device_s`, not in its busy seconds): a stage before only queues its
    device work, so its seconds are the host's, and the device's time shows here."""

    batches: int = 0
    busy_s: float = 0.0
    starved_s: float = 0.0
    blocked_s: float = 0.0
    device_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        seconds = {"busy_s": self.busy_s, "starved_s": self.starved_s,
                   "blocked_s": self.blocked_s, "device_s": self.device_s}  # fmt: skip
        return {"batches": self.batches, **{k: round(v, 3) for k, v in seconds.items()}}


_STOP = object()  # a stage thread's signal to end

# A stage busier than this share of the device stages' loaded time held the others back; when no
# stage is, the batches came slower than the stages ran them.
BOTTLENECK_SHARE = 0.8
DEVICE = "device"  # in the busy shares: the last stage's wait for the device work before it


@dataclass
class Loaded:
    """Seconds with at least one batch inside the device stages: the time their busy seconds
    are shares of. Long-lived device stages (a worker's) are empty between jobs, so a stage's
    starved seconds say little by themselves; its busy share of the loaded time does."""

    seconds: float = 0.0
    inside: int = 0
    since: float = 0.0

    def enter(self, now: float) -> None:
        if self.inside == 0:
            self.since = now
        self.inside += 1

    def leave(self, now: float) -> None:
        self.inside -= 1
        if self.inside == 0:
            self.seconds += now - self.since

    def so_far(self, now: float) -> float:
        return self.seconds + (now - self.since if self.inside else 0.0)


class DeviceStages:
    """`stages` run overlapped over submitted batches; `run(payload)` is one batch's trip
    (it blocks while the first queue is full: the caller is back-pressured, not queued up)."""

    def __init__(
        self, name: str, stages: Sequence[Stage], streams: Streams, depth: int = DEPTH
    ) -> None:
        if not stages:
            raise ValueError("The device stages need at least one stage.")
        self.name = name
        self.stages = list(stages)
        self._streams = streams
        self._queues: list[queue.Queue[Any]] = [queue.Queue(depth) for _ in self.stages]
        self._stats = {stage.name: StageStats() for stage in self.stages}
        self._loaded = Loaded()
        self._lock = threading.Lock()  # stats, the loaded time, the threads left
        # A batch is put in and the device stages closed one at a time: a batch put in after the
        # stops would find no thread to run it. Stage threads never take it.
        self._entry = threading.Lock()
        self._left = [stage.threads for stage in self.stages]  # threads still running
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True,
                             name=f"{name}-{stage.name}-{n}")
            for i, stage in enumerate(self.stages) for n in range(stage.threads)
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    @property
    def in_flight(self) -> int:
        """Batches a caller may usefully have submitted at once: one running in each stage
        thread and `depth` waiting before each stage."""
        return sum(s.threads for s in self.stages) + sum(q.maxsize for q in self._queues)

    def submit(self, payload: Any) -> Future[Any]:
        work = Work(payload)
        with self._entry:
            if self._closed:
                raise RuntimeError(f"The {self.name} device stages are closed.")
            with self._lock:
                self._loaded.enter(time.perf_counter())
            work.future.add_done_callback(self._out)  # answered or failed: it is out
            self._queues[0].put(work)  # may wait for room: the stages drain without the lock
        return work.future

    def _out(self, _future: Future[Any]) -> None:
        with self._lock:
            self._loaded.leave(time.perf_counter())

    def run(self, payload: Any) -> Any:
        return self.submit(payload).result()

    def stats(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {name: stats.as_dict() for name, stats in self._stats.items()}

    def busy_shares(self) -> tuple[float, dict[str, float]]:
        """The seconds the device stages held a batch, and each stage's busy share of them (per
        thread: 1.0 is a stage whose threads never rested while there was work); `device`:
        the last stage's share waiting for the device work before it."""
        with self._lock:
            loaded = self._loaded.so_far(time.perf_counter())
            busy = {stage.name: self._stats[stage.name].busy_s / stage.threads
                    for stage in self.stages}  # fmt: skip
            last = self.stages[-1]
            busy[DEVICE] = self._stats[last.name].device_s / last.threads
        return loaded, {name: (b / loaded if loaded > 0 else 0.0) for name, b in busy.items()}

    def verdict(self) -> str:
        """Where the time went, in a sentence: the stage that held the others back, or that
        none did (the batches came slower than the stages ran them)."""
        loaded, shares = self.busy_shares()
        if loaded <= 0:
            return "no batch ran"
        parts = ", ".join(f"{name} {share:.0%}" for name, share in shares.items())
        slowest, last = max(shares, key=shares.__getitem__), self.stages[-1].name
        if shares[slowest] >= BOTTLENECK_SHARE:
            said = f"{slowest} held the others back"
            if slowest == DEVICE:
                said = f"the device held the others back ({last} waited for its work)"
        elif shares[last] + shares[DEVICE] >= BOTTLENECK_SHARE:
            said = f"{last}, waiting for the device then finishing, held the others back"
        else:
            said = "no stage was busy most of that time: the batches came slower than it ran them"
        return f"{loaded:.1f} s with batches inside; busy per thread: {parts}; {said}"

    def close(self, timeout: float | None = 10.0) -> None:
        """Finish the batches submitted, then stop every stage thread."""
        with self._entry:
            if self._closed:
                return
            self._closed = True
            for _ in range(self.stages[0].threads):
                self._queues[0].put(_STOP)
        for thread in self._threads:
            thread.join(timeout)
        self._fail_left_over()
        log.info("%s pipeline closed: %s; per stage: %s", self.name, self.verdict(), self.stats())

    def _fail_left_over(self) -> None:
        """A batch still queued after the joins (a stage past `timeout`) fails, so no caller
        waits on it for ever; the stops go back, for the threads still running."""
        for inbox in self._queues:
            stops = 0
            while True:
                try:
                    work = inbox.get_nowait()
                except queue.Empty:
                    break
                if work is _STOP:
                    stops += 1
                else:
                    _fail(work, RuntimeError(f"The {self.name} device stages closed."))
            for _ in range(stops):
                inbox.put_nowait(_STOP)

    # --- a stage thread ----------------------------------------------------------------

    def _loop(self, index: int) -> None:
        stage, inbox = self.stages[index], self._queues[index]
        stream = self._streams.new()
        stats = self._stats[stage.name]
        while True:
            waited = time.perf_counter()
            work = inbox.get()
            got = time.perf_counter()
            if work is _STOP:
                self._stopped(index)
                return
            device_s = self._settle(work) if index == len(self.stages) - 1 else 0.0
            failed = work.future.done() or self._step(stage, stream, work)
            done = time.perf_counter()
            if not failed:
                self._pass_on(index, work)
            with self._lock:
                stats.batches += 1
                stats.starved_s += got - waited
                stats.device_s += device_s
                stats.busy_s += done - got - device_s
                stats.blocked_s += time.perf_counter() - done

    def _settle(self, work: Work) -> float:
        """The last stage's wait for the device work queued before it: its seconds (a failure
        there is the batch's)."""
        started = time.perf_counter()
        try:
            self._streams.settle(work.event)
        except BaseException as error:
            _fail(work, error)
        return time.perf_counter() - started

    def _step(self, stage: Stage, stream: Any, work: Work) -> bool:
        """Run `stage` on `work` on this thread's stream; True when it failed (its caller
        hears of it, and the batch goes no further)."""
        streams = self._streams
        try:
            with streams.using(stream):
                streams.wait(stream, work.event)
                streams.hand_over(work.values, stream)
                stage.run(work)
                work.event = streams.record(stream)
        except BaseException as error:
            _fail(work, error)
            return True
        return False

    def _pass_on(self, index: int, work: Work) -> None:
        if index + 1 < len(self._queues):
            self._queues[index + 1].put(work)
        elif not work.future.done():
            work.future.set_result(work.result)

    def _stopped(self, index: int) -> None:
        """The last thread of a stage to stop tells each thread of the next stage."""
        with self._lock:
            self._left[index] -= 1
            last = self._left[index] == 0
        if last and index + 1 < len(self.stages):
            for _ in range(self.stages[index + 1].threads):
                self._queues[index + 1].put(_STOP)


def _fail(work: Work, error: BaseException) -> None:
    """The batch's caller hears of `error` (unless it has its answer, or gave up on it)."""
    if not work.future.done():
        work.future.set_exception(error)
