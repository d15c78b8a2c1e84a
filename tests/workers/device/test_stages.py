"""The device stages (`device/stages.py`) on the CPU, behind stand-in stages: batches
overlap across stages, queues bound what is in flight, a stage's failure is its batch's alone,
device work is ordered by events and handed over between streams (a recording stand-in for
CUDA's), and `close` finishes what was submitted. What only a GPU shows (real streams and
events, the stages' device work overlapping) is in tests/gpu and bench.gpu."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kiln.workers.device.stages import CpuStreams, DeviceStages, Stage, Work

STEP_S = 0.03


def sleeper(name: str, seconds: float = STEP_S) -> Stage:
    def run(work: Work) -> None:
        time.sleep(seconds)
        work.values.setdefault("trail", []).append(name)
        work.result = (work.payload, list(work.values["trail"]))

    return Stage(name, run)


def four() -> list[Stage]:
    return [sleeper(name) for name in ("decode", "fit", "forward", "outputs")]


def test_batches_overlap_across_stages() -> None:
    """16 batches through 4 stages of 30 ms: one after another would take 1.9 s; staged, each
    stage works on one batch while the others work on theirs (~0.6 s)."""
    device_stages = DeviceStages("test", four(), CpuStreams())
    started = time.perf_counter()
    with ThreadPoolExecutor(device_stages.in_flight) as callers:
        results = list(callers.map(device_stages.run, range(16)))
    took = time.perf_counter() - started
    device_stages.close()
    assert results == [(i, ["decode", "fit", "forward", "outputs"]) for i in range(16)]
    serial = 16 * 4 * STEP_S
    assert took < 0.6 * serial, f"{took:.2f} s staged against {serial:.2f} s one by one"
    stats = device_stages.stats()
    assert [stats[name]["batches"] for name in ("decode", "fit", "forward", "outputs")] == [16] * 4
    assert stats["forward"]["busy_s"] >= 16 * STEP_S * 0.9


def test_queues_bound_the_batches_in_flight() -> None:
    """A slow last stage: callers are held at the first queue, never more batches inside than
    its threads and queues hold."""
    inside, most, lock = [0], [0], threading.Lock()

    def enter(work: Work) -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])

    def leave(work: Work) -> None:
        time.sleep(0.05)
        with lock:
            inside[0] -= 1

    device_stages = DeviceStages("test", [Stage("in", enter), Stage("out", leave)], CpuStreams())
    assert device_stages.in_flight == 2 + 2 * 2  # a thread per stage, two batches before each
    with ThreadPoolExecutor(20) as callers:
        list(callers.map(device_stages.run, range(20)))
    device_stages.close()
    assert (
        most[0] <= device_stages.in_flight - 1
    )  # the first stage's queue holds batches not yet in


def test_a_failing_stage_fails_its_batch_alone() -> None:
    seen: list[int] = []

    def picky(work: Work) -> None:
        if work.payload == 3:
            raise ValueError("batch 3 is bad")

    def last(work: Work) -> None:
        seen.append(work.payload)
        work.result = work.payload

    device_stages = DeviceStages("test", [Stage("picky", picky), Stage("last", last)], CpuStreams())
    futures = [device_stages.submit(i) for i in range(6)]
    with pytest.raises(ValueError, match="batch 3 is bad"):
        futures[3].result(5)
    assert [f.result(5) for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4, 5]
    device_stages.close()
    assert 3 not in seen


def test_a_stage_may_run_on_several_threads() -> None:
    """A decoder with per-thread state: two decode threads at once, each batch still its own."""
    running, most, lock = [0], [0], threading.Lock()

    def decode(work: Work) -> None:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.03)
        with lock:
            running[0] -= 1
        work.values["decoded"] = work.payload * 10

    def out(work: Work) -> None:
        work.result = work.values["decoded"]

    stages = [Stage("decode", decode, threads=2), Stage("out", out)]
    device_stages = DeviceStages("test", stages, CpuStreams())
    with ThreadPoolExecutor(device_stages.in_flight) as callers:
        assert list(callers.map(device_stages.run, range(12))) == [i * 10 for i in range(12)]
    device_stages.close()
    assert most[0] == 2


def test_close_finishes_what_was_submitted_then_refuses() -> None:
    device_stages = DeviceStages("test", four(), CpuStreams())
    futures = [device_stages.submit(i) for i in range(3)]
    device_stages.close()
    assert [f.result(0) for f in futures] == [(i, ["decode", "fit", "forward", "outputs"])
                                              for i in range(3)]  # fmt: skip
    assert not any(t.is_alive() for t in device_stages._threads)
    with pytest.raises(RuntimeError, match="closed"):
        device_stages.submit(9)


class RecordingStreams:
    """CUDA's part as calls: which stream each stage waits on for which event, and what
    crosses to it."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []
        self._count = 0
        self._lock = threading.Lock()

    def new(self) -> Any:
        with self._lock:
            self._count += 1
            return f"stream-{self._count}"

    def using(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def record(self, stream: Any) -> Any:
        return f"event-on-{stream}"

    def wait(self, stream: Any, event: Any) -> None:
        with self._lock:
            self.calls.append(("wait", stream, event))

    def hand_over(self, value: Any, stream: Any) -> None:
        with self._lock:
            self.calls.append(("hand_over", stream, sorted(value)))

    def settle(self, event: Any) -> None:
        with self._lock:
            self.calls.append(("settle", None, event))


def test_each_stage_waits_for_the_previous_stages_event_on_its_own_stream() -> None:
    def make(work: Work) -> None:
        work.values["pixels"] = "tensor"

    def use(work: Work) -> None:
        work.result = work.values["pixels"]

    streams = RecordingStreams()
    device_stages = DeviceStages("test", [Stage("make", make), Stage("use", use)], streams)
    assert device_stages.run(1) == "tensor"
    device_stages.close()
    waits = [c for c in streams.calls if c[0] == "wait"]
    handed = [c for c in streams.calls if c[0] == "hand_over"]
    first, second = waits[0][1], waits[1][1]
    assert first != second  # each stage its own stream
    assert waits[0][2] is None  # nothing before the first stage
    assert waits[1][2] == f"event-on-{first}"  # the second waits for the first's work
    assert handed[1] == ("hand_over", second, ["pixels"])  # what crosses is handed over
    # the last stage first waits, on the host, for the device work queued before it
    assert [c for c in streams.calls if c[0] == "settle"] == [("settle", None, waits[1][2])]


def test_the_close_names_the_stage_that_held_the_others_back() -> None:
    """A slow stage is busy nearly all the time batches are inside; the pause between two
    bursts (a worker between jobs) is not time any stage could have worked."""
    stages = [sleeper("decode", 0.04), sleeper("fit", 0.005), sleeper("outputs", 0.005)]
    device_stages = DeviceStages("test", stages, CpuStreams())
    started = time.perf_counter()
    for _burst in range(2):
        with ThreadPoolExecutor(device_stages.in_flight) as callers:
            list(callers.map(device_stages.run, range(10)))
        time.sleep(0.3)  # empty: starved, but not loaded
    loaded, shares = device_stages.busy_shares()
    took = time.perf_counter() - started
    device_stages.close()
    assert 20 * 0.04 <= loaded <= took - 2 * 0.3, (loaded, took)  # the pauses are not in it
    assert shares["decode"] > 0.8 and shares["fit"] < 0.5, shares
    assert "decode held the others back" in device_stages.verdict()


def test_unused_device_stages_say_so() -> None:
    device_stages = DeviceStages("test", four(), CpuStreams())
    device_stages.close()
    assert device_stages.verdict() == "no batch ran"


def test_the_close_says_when_no_stage_was_the_limit() -> None:
    """One batch at a time: each stage works a part of each batch's trip, none most of it."""
    device_stages = DeviceStages("test", four(), CpuStreams())
    for i in range(5):
        device_stages.run(i)
    loaded, shares = device_stages.busy_shares()
    device_stages.close()
    assert loaded >= 5 * 4 * STEP_S  # each batch's whole trip, one after another
    assert all(0.1 < shares[name] < 0.5 for name in ("decode", "fit", "forward", "outputs"))
    assert shares["device"] < 0.01  # on the CPU a stage's work is done when it returns
    assert "the batches came slower than it ran them" in device_stages.verdict()


def test_a_batch_put_in_while_the_device_stages_close_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A caller held up between its check that the device stages are open and its put (here: a
    slow queue) while `close` runs: its batch still gets its answer, not a wait for ever."""
    import queue as queues

    from kiln.workers.device import stages as module

    class SlowPut(queues.Queue[Any]):
        def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
            if item is not module._STOP:
                time.sleep(0.2)
            super().put(item, block, timeout)

    monkeypatch.setattr(module.queue, "Queue", SlowPut)
    device_stages = DeviceStages("test", [sleeper("only", 0.0)], CpuStreams())
    monkeypatch.undo()
    with ThreadPoolExecutor(1) as caller:
        submitted = caller.submit(device_stages.submit, 7)
        time.sleep(0.05)  # the caller is inside its put
        device_stages.close(timeout=2)
        assert submitted.result(2).result(2) == (7, ["only"])
    assert device_stages.busy_shares()[0] >= 0  # the loaded time balanced: nothing left inside
    assert device_stages._loaded.inside == 0


class SlowDevice(CpuStreams):
    """A device that takes `seconds` to finish what each batch queued before the last stage
    (on a GPU: the forward's kernels, which its stage only launched)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def settle(self, event: Any) -> None:
        time.sleep(self.seconds)


def test_the_device_is_named_when_the_last_stage_waits_for_it() -> None:
    """A forward stage that only launches its work looks idle; the last stage's wait for the
    device is counted apart from its own busy seconds, and names the device."""
    stages = [sleeper("forward", 0.002), sleeper("outputs", 0.002)]
    device_stages = DeviceStages("test", stages, SlowDevice(0.04))
    with ThreadPoolExecutor(device_stages.in_flight) as callers:
        list(callers.map(device_stages.run, range(12)))
    _loaded, shares = device_stages.busy_shares()
    stats = device_stages.stats()
    device_stages.close()
    assert stats["outputs"]["device_s"] >= 12 * 0.04 * 0.9
    assert stats["outputs"]["busy_s"] < 12 * 0.04 / 2  # its own work only
    assert shares["device"] > 0.8, shares
    assert (
        "the device held the others back (outputs waited for its work)" in device_stages.verdict()
    )


def test_a_failed_device_wait_fails_its_batch_alone() -> None:
    class Faulty(CpuStreams):
        def settle(self, event: Any) -> None:
            if faults.pop() == "bad":
                raise RuntimeError("CUDA error: an illegal memory access")

    faults = ["ok", "bad"]  # popped from the end: the first batch's wait fails
    device_stages = DeviceStages(
        "test", [sleeper("forward", 0.0), sleeper("outputs", 0.0)], Faulty()
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):
        device_stages.run(1)
    assert device_stages.run(2) == (2, ["forward", "outputs"])
    device_stages.close()
    assert device_stages._loaded.inside == 0


def test_a_close_past_its_timeout_fails_what_waits_and_the_slow_stage_still_stops() -> None:
    """A stage slower than `close`'s timeout: the batch still queued fails (its caller hears
    of it), the one running finishes, and its thread still finds its stop afterwards."""
    device_stages = DeviceStages("test", [sleeper("slow", 0.4)], CpuStreams())
    running, queued = device_stages.submit(1), device_stages.submit(2)
    time.sleep(0.05)  # 1 is running, 2 waits in the queue
    device_stages.close(timeout=0.05)
    with pytest.raises(RuntimeError, match="device stages closed"):
        queued.result(1)
    assert running.result(2) == (1, ["slow"])
    for thread in device_stages._threads:
        thread.join(2)
    assert not any(t.is_alive() for t in device_stages._threads)


class FakeTensor:
    """What `CudaStreams.hand_over` reads of a tensor: where it lives, and its record."""

    def __init__(self, is_cuda: bool = True) -> None:
        self.is_cuda = is_cuda
        self.recorded: list[Any] = []

    def record_stream(self, stream: Any) -> None:
        self.recorded.append(stream)


class FakeTorch:
    """torch's CUDA API as `CudaStreams` calls it, recording which contexts a step enters."""

    def __init__(self) -> None:
        import contextlib
        from types import SimpleNamespace

        self.entered: list[str] = []
        fake = self

        class Device:
            def __init__(self, name: Any) -> None:
                self.name = name

            def __enter__(self) -> None:
                fake.entered.append("device")

            def __exit__(self, *exc: object) -> None:
                return None

        @contextlib.contextmanager
        def stream(s: Any) -> Any:
            fake.entered.append(f"stream {s}")
            yield

        self.device = Device
        self.cuda = SimpleNamespace(Stream=lambda device=None: "s1", stream=stream)


def test_a_cuda_step_enters_its_stream_only_and_hands_over_each_tensor_once() -> None:
    """No `torch.device` context around a stage (a Python call on each of its torch ops): its
    stream only. What crosses is recorded on the next stage's stream once per tensor — one per
    size group, not one per image — and what is not device memory is not walked."""
    from kiln.workers.device.stages import CudaStreams, tensors_in

    torch = FakeTorch()
    streams = CudaStreams(torch, "cuda:0")
    with streams.using("s1"):
        pass
    assert torch.entered == ["stream s1"]
    groups, pixels, on_host = [FakeTensor(), FakeTensor()], FakeTensor(), FakeTensor(False)
    values = {"images": groups, "pixels": pixels, "nested": {"x": (on_host,)}, "rows": 32}
    streams.hand_over(values, "s2")
    assert [t.recorded for t in (*groups, pixels, on_host)] == [["s2"], ["s2"], ["s2"], []]
    assert list(tensors_in(values)) == [*groups, pixels, on_host]
    assert list(tensors_in([1, "a", None])) == []


def test_what_a_stage_keeps_on_the_host_is_never_handed_over() -> None:
    def make(work: Work) -> None:
        work.values["pixels"] = "tensor"
        work.host["rows"] = list(range(64))

    def use(work: Work) -> None:
        work.result = (work.values["pixels"], len(work.host["rows"]))

    streams = RecordingStreams()
    device_stages = DeviceStages("test", [Stage("make", make), Stage("use", use)], streams)
    assert device_stages.run(1) == ("tensor", 64)
    device_stages.close()
    assert [c[2] for c in streams.calls if c[0] == "hand_over"] == [[], ["pixels"]]
