"""The Batcher on its own: batch release rules, one future per block, blocks cut across and
shared between batches, bisection, close, stats."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kiln.app.core.errors import KilnError, TransientError
from kiln.workers.batching import (
    Batcher,
    BatcherClosedError,
    BatchPolicy,
    ListShape,
    Part,
    WithdrawnError,
)

RESULT_TIMEOUT = 2.0

Block = list[Any]  # a block of rows: a list, cut by `Part`s
BatchFn = Callable[[Sequence[Part[Block]]], list[Any]]


def rows_of(parts: Sequence[Part[Block]]) -> list[Any]:
    """The batch's rows, in order, from the block parts it was cut from."""
    return [row for part in parts for row in part.block[part.start : part.stop]]


def doubled(parts: Sequence[Part[Block]]) -> list[Any]:
    return [x * 2 for x in rows_of(parts)]


class Recorder:
    """A batch function over rows that records every batch (its rows, and its parts)."""

    def __init__(self, fn: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.fn = fn or (lambda rows: [x * 2 for x in rows])
        self.calls: list[list[Any]] = []
        self.parts: list[list[tuple[int, int, int]]] = []  # (id of the block, start, stop)
        self._lock = threading.Lock()

    def __call__(self, parts: Sequence[Part[Block]]) -> list[Any]:
        rows = rows_of(parts)
        with self._lock:
            self.calls.append(rows)
            self.parts.append([(id(p.block), p.start, p.stop) for p in parts])
        return self.fn(rows)

    @property
    def sizes(self) -> list[int]:
        with self._lock:
            return [len(c) for c in self.calls]


@pytest.fixture
def make_batcher() -> Iterator[Callable[..., Batcher[Block, list[Any]]]]:
    made: list[Batcher[Block, list[Any]]] = []

    def make(fn: BatchFn, **knobs: Any) -> Batcher[Block, list[Any]]:
        batcher: Batcher[Block, list[Any]] = Batcher(fn, ListShape(), BatchPolicy(**knobs))
        made.append(batcher)
        return batcher

    yield make
    for batcher in made:
        batcher.close(timeout=2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch": 0, "max_delay_s": 0.01},
        {"max_batch": 1, "max_delay_s": -1.0},
        {"max_batch": 1, "max_delay_s": 0.01, "runners": 0},
    ],
)
def test_rejects_bad_knobs(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        BatchPolicy(**kwargs)


def test_full_batch_is_released_without_waiting_for_the_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=5.0)
    started = time.monotonic()
    result = batcher.submit([1, 2, 3, 4]).result(timeout=RESULT_TIMEOUT)
    elapsed = time.monotonic() - started
    assert result == [2, 4, 6, 8]
    assert elapsed < 0.5, f"a full batch waited {elapsed:.3f}s (max_delay is 5s)"
    assert fn.sizes == [4]


def test_partial_batch_is_released_after_max_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=10, max_delay_s=0.05)
    started = time.monotonic()
    result = batcher.submit([1, 2, 3]).result(timeout=RESULT_TIMEOUT)
    elapsed = time.monotonic() - started
    assert result == [2, 4, 6]
    assert fn.sizes == [3]
    assert 0.045 <= elapsed < 0.5


def test_one_future_per_block_with_its_rows_results_in_order(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=0.01)
    blocks = [list(range(0, 3)), list(range(3, 10)), [10], list(range(11, 16))]
    futures = [batcher.submit(block) for block in blocks]
    assert len(futures) == len(blocks)
    for block, future in zip(blocks, futures, strict=True):
        assert future.result(timeout=RESULT_TIMEOUT) == [x * 2 for x in block]
    assert all(size <= 4 for size in fn.sizes)
    assert sorted(x for call in fn.calls for x in call) == list(range(16))


def test_a_block_split_across_two_batches_gets_its_results_joined_in_order(
    make_batcher,
) -> None:
    """max_batch 4 over blocks of 3 and 3: the second block's rows go in two batches, and its
    one future holds all three results, in the block's order."""
    fn = Recorder(lambda rows: [f"r{x}" for x in rows])
    batcher = make_batcher(fn, max_batch=4, max_delay_s=5.0, greedy=True)
    first, second = ["a", "b", "c"], ["d", "e", "f"]
    with batcher.expect(6) as announced:
        a = announced.submit(first)
        b = announced.submit(second)
    assert a.result(timeout=RESULT_TIMEOUT) == ["ra", "rb", "rc"]
    assert b.result(timeout=RESULT_TIMEOUT) == ["rd", "re", "rf"]
    assert fn.calls == [["a", "b", "c", "d"], ["e", "f"]]
    assert fn.parts == [
        [(id(first), 0, 3), (id(second), 0, 1)],
        [(id(second), 1, 3)],
    ]


def test_blocks_from_several_callers_share_one_batch(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=6, max_delay_s=5.0)
    gate = threading.Barrier(3)
    blocks = [[1, 2], [10, 20], [100, 200]]
    results: dict[int, list[Any]] = {}

    def caller(k: int) -> None:
        gate.wait(RESULT_TIMEOUT)
        results[k] = batcher.submit(blocks[k]).result(timeout=RESULT_TIMEOUT)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(RESULT_TIMEOUT)
    assert time.monotonic() - started < 1.0  # the full batch went without waiting the delay
    assert results == {k: [x * 2 for x in block] for k, block in enumerate(blocks)}
    assert fn.sizes == [6]
    assert sorted((start, stop) for _, start, stop in fn.parts[0]) == [(0, 2)] * 3
    assert len({block for block, _, _ in fn.parts[0]}) == 3  # three callers' blocks


def test_an_empty_block_is_answered_at_once(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=5.0)
    assert batcher.submit([]).result(timeout=0) == []
    assert fn.calls == []


def test_a_bad_row_fails_alone_by_bisection(make_batcher) -> None:
    def fn_(rows: list[Any]) -> list[Any]:
        if "bad" in rows:
            raise ValueError("bad row in batch")
        return [f"ok:{r}" for r in rows]

    fn = Recorder(fn_)
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.5)
    first: list[Any] = [0, 1, 2, 3]
    second: list[Any] = [4, "bad", 6, 7]
    with batcher.expect(8) as announced:
        futures = [announced.submit(first), announced.submit(second)]

    assert futures[0].result(timeout=RESULT_TIMEOUT) == [f"ok:{r}" for r in first]
    answers = futures[1].result(timeout=RESULT_TIMEOUT)
    assert len(answers) == len(second)
    for row, answer in zip(second, answers, strict=True):
        if row == "bad":  # the row's answer is its error; the rest of its block stands
            assert isinstance(answer, ValueError) and "bad row" in str(answer)
        else:
            assert answer == f"ok:{row}"

    # Depth first: [0..7] fails → [0..3] ok, [4..7] fails → [4, bad] fails → [4] ok,
    # [bad] fails → [6, 7] ok. Failures at sizes 8, 4, 2 and 1.
    rows = first + second
    assert fn.calls == [rows, rows[:4], rows[4:], [4, "bad"], [4], ["bad"], [6, 7]]
    assert batcher.stats.failed_batches == 4
    assert batcher.stats.batches == 1
    assert batcher.stats.rows == 8


class FlakyEngine(TransientError):
    """An error that says another try may succeed (a lost device, a stuck engine)."""


def test_a_transient_error_of_one_row_fails_only_its_blocks_future(make_batcher) -> None:
    """Alone, a row whose error is transient fails its whole block (the chunk runs again);
    the blocks that shared its batch keep their answers."""

    def fn_(rows: list[Any]) -> list[Any]:
        if "flaky" in rows:
            raise FlakyEngine("the device went away")
        return [f"ok:{r}" for r in rows]

    fn = Recorder(fn_)
    batcher = make_batcher(fn, max_batch=6, max_delay_s=5.0)
    blocks: list[Block] = [[1, 2], [3, "flaky"], [5, 6]]
    with batcher.expect(6) as announced:
        futures = [announced.submit(block) for block in blocks]
    assert futures[0].result(timeout=RESULT_TIMEOUT) == ["ok:1", "ok:2"]
    with pytest.raises(FlakyEngine, match="the device went away"):
        futures[1].result(timeout=RESULT_TIMEOUT)
    assert futures[2].result(timeout=RESULT_TIMEOUT) == ["ok:5", "ok:6"]
    assert ["flaky"] in fn.calls  # isolated by bisection before it failed the block
    assert fn.sizes[0] == 6


class FakeCudaOutOfMemory(RuntimeError):
    pass


FakeCudaOutOfMemory.__name__ = "OutOfMemoryError"  # as cupy.cuda.memory.OutOfMemoryError


@pytest.mark.parametrize(
    "oom",
    [
        pytest.param(lambda n: MemoryError(), id="MemoryError"),
        pytest.param(lambda n: FakeCudaOutOfMemory(f"out of memory allocating {n}"), id="cupy"),
        pytest.param(
            lambda n: RuntimeError("[ONNXRuntimeError] : 6 : Failed to allocate memory"), id="ort"
        ),
    ],
)
def test_out_of_memory_splits_the_batch_and_lowers_the_cap(
    make_batcher, oom: Callable[[int], Exception]
) -> None:
    """An engine that cannot hold more than 2 rows: the batch of 8 is split, every row gets
    its answer, and later batches are never larger than what fit."""

    def fn_(rows: list[Any]) -> list[Any]:
        if len(rows) > 2:
            raise oom(len(rows))
        return [r * 10 for r in rows]

    fn = Recorder(fn_)
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.5)
    assert batcher.submit(list(range(8))).result(RESULT_TIMEOUT) == [r * 10 for r in range(8)]
    assert fn.sizes[:3] == [8, 4, 2]  # halved until it fits
    assert batcher.max_batch == 2
    assert batcher.stats.out_of_memory == 2  # the batches of 8 and 4

    fn.calls.clear()
    assert batcher.submit(list(range(6))).result(RESULT_TIMEOUT) == [r * 10 for r in range(6)]
    assert max(fn.sizes) <= 2 and batcher.stats.out_of_memory == 2


def test_an_ordinary_error_does_not_lower_the_cap(make_batcher) -> None:
    def fn_(rows: list[Any]) -> list[Any]:
        if "bad" in rows:
            raise ValueError("bad row")
        return list(rows)

    batcher = make_batcher(Recorder(fn_), max_batch=4, max_delay_s=0.5)
    answers = batcher.submit([1, "bad", 3, 4]).result(RESULT_TIMEOUT)
    assert answers[0] == 1 and isinstance(answers[1], ValueError) and answers[2:] == [3, 4]
    assert batcher.max_batch == 4 and batcher.stats.out_of_memory == 0


@pytest.mark.parametrize(
    "wrong",
    [
        pytest.param(lambda rows: [*rows, "extra"], id="too-many"),
        pytest.param(lambda rows: list(rows)[1:], id="too-few"),
    ],
)
def test_wrong_number_of_results_fails_the_rows(make_batcher, wrong) -> None:
    batcher = make_batcher(Recorder(wrong), max_batch=4, max_delay_s=0.5)
    answers = batcher.submit([1, 2, 3, 4]).result(timeout=RESULT_TIMEOUT)
    assert len(answers) == 4
    for answer in answers:
        assert isinstance(answer, RuntimeError)
        assert re.search(r"returned \d+ results for 1 rows", str(answer)), answer
    assert batcher.stats.failed_batches > 0


def test_cancelled_blocks_are_not_sent_to_the_engine(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=10, max_delay_s=0.2)
    futures = [batcher.submit([1]), batcher.submit([2, 20]), batcher.submit([3])]
    assert futures[1].cancel()
    assert futures[0].result(timeout=RESULT_TIMEOUT) == [2]
    assert futures[2].result(timeout=RESULT_TIMEOUT) == [6]
    assert futures[1].cancelled()
    assert fn.calls == [[1, 3]]


def test_submit_after_close_raises() -> None:
    batcher: Batcher[Block, list[Any]] = Batcher(
        rows_of, ListShape(), BatchPolicy(max_batch=2, max_delay_s=0.01)
    )
    batcher.close()
    with pytest.raises(BatcherClosedError) as caught:
        batcher.submit([1])
    assert isinstance(caught.value, KilnError)  # a sentence Kiln raised on purpose
    assert str(caught.value).endswith("is closed.")
    with pytest.raises(BatcherClosedError), batcher.expect(2) as announced:
        announced.submit([1, 2])
    assert batcher._intake.announced == 0
    batcher.close()  # a second close is harmless


def test_close_drains_queued_blocks_without_waiting_out_the_delay() -> None:
    fn = Recorder()
    batcher: Batcher[Block, list[Any]] = Batcher(
        fn, ListShape(), BatchPolicy(max_batch=100, max_delay_s=5.0, runners=2)
    )
    futures = [batcher.submit([1, 2]), batcher.submit([3]), batcher.submit([4, 5])]
    started = time.monotonic()
    batcher.close(timeout=2.0)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0
    assert all(f.done() for f in futures)
    assert [f.result(timeout=0) for f in futures] == [[2, 4], [6], [8, 10]]
    assert not any(t.is_alive() for t in batcher._threads)


def _thread_cpu_seconds(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_idle_batcher_does_not_poll(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=0.001)
    runner = batcher._threads[0]
    can_measure = hasattr(time, "pthread_getcpuclockid")
    cpu_before = _thread_cpu_seconds(runner) if can_measure else 0.0
    time.sleep(0.3)
    assert runner.is_alive()
    assert fn.calls == []
    assert batcher.stats.batches == 0
    if can_measure:
        assert _thread_cpu_seconds(runner) - cpu_before < 0.02


def test_runners_work_concurrently(make_batcher) -> None:
    """One block of two rows, one row a batch: two runners run its batches at once, and the
    block's future joins their results in order."""

    def slow(parts: Sequence[Part[Block]]) -> list[Any]:
        time.sleep(0.1)
        return rows_of(parts)

    batcher = make_batcher(slow, max_batch=1, max_delay_s=0.0, runners=2)
    started = time.monotonic()
    assert batcher.submit([1, 2]).result(timeout=RESULT_TIMEOUT) == [1, 2]
    elapsed = time.monotonic() - started
    assert elapsed < 0.18, f"two 0.1s batches on two runners took {elapsed:.3f}s"
    assert batcher.stats.batches == 2


def test_stats_count_sizes_and_mean(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=3, max_delay_s=0.1)
    assert batcher.stats.mean_batch == 0.0
    assert batcher.submit(list(range(7))).result(timeout=RESULT_TIMEOUT) == [
        x * 2 for x in range(7)
    ]
    batcher.close()  # the totals are written after the futures resolve
    stats = batcher.stats
    assert fn.sizes == [3, 3, 1]
    assert stats.batches == 3
    assert stats.rows == 7
    assert dict(stats.size_counts) == {3: 2, 1: 1}
    assert stats.mean_batch == pytest.approx(7 / 3)
    assert stats.failed_batches == 0
    assert stats.engine_seconds >= 0.0
    assert stats.queue_wait_seconds >= 0.0
    assert sum(stats.wait_counts.values()) == 7  # one per row (the block went in three parts)
    assert sum(stats.engine_counts.values()) == 3  # one per batch


def test_greedy_runs_a_lone_block_at_once(make_batcher) -> None:
    """Nothing else is announced: an interactive block does not wait out the delay."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    started = time.monotonic()
    assert batcher.submit([1]).result(timeout=RESULT_TIMEOUT) == [2]
    assert time.monotonic() - started < 1.0


def test_greedy_waits_for_announced_rows(make_batcher) -> None:
    """A chunk announces its rows and submits them in blocks as it decodes them: one batch."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    with batcher.expect(3) as announced:
        futures = [announced.submit([1])]
        time.sleep(0.1)  # decoding the next inputs
        futures += [announced.submit([2, 3])]
        assert [f.result(timeout=RESULT_TIMEOUT) for f in futures] == [[2], [4, 6]]
    assert fn.sizes == [3]


def test_greedy_stops_waiting_when_announced_rows_are_written_off(make_batcher) -> None:
    """The last input failed to decode: its row never comes, and the batch goes at once."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    started = time.monotonic()
    with batcher.expect(2) as announced:
        future = announced.submit([1])
    assert future.result(timeout=RESULT_TIMEOUT) == [2]
    assert time.monotonic() - started < 1.0


def test_greedy_still_caps_the_wait_at_max_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.05, greedy=True)
    with batcher.expect(2) as announced:
        started = time.monotonic()
        assert announced.submit([1]).result(timeout=RESULT_TIMEOUT) == [2]
        assert 0.045 <= time.monotonic() - started < 1.0
    assert fn.sizes == [1]


def test_max_queued_makes_submit_wait_for_the_engine(make_batcher) -> None:
    gate = threading.Event()

    def slow(parts: Sequence[Part[Block]]) -> list[Any]:
        gate.wait(RESULT_TIMEOUT)
        return rows_of(parts)

    batcher = make_batcher(slow, max_batch=1, max_delay_s=0.0, max_queued=2)
    batcher.submit([1])  # taken by the runner, which blocks on the gate
    time.sleep(0.05)
    batcher.submit([2, 3])  # a block of two rows fills the queue (counted in rows)
    blocked = threading.Thread(target=batcher.submit, args=([4],))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive(), "submit should wait while the queue is full"
    gate.set()
    blocked.join(RESULT_TIMEOUT)
    assert not blocked.is_alive()


def test_close_releases_a_blocked_submitter(make_batcher) -> None:
    gate = threading.Event()
    batcher = make_batcher(
        lambda parts: gate.wait(RESULT_TIMEOUT) and rows_of(parts),
        max_batch=1,
        max_delay_s=0.0,
        max_queued=1,
    )
    batcher.submit([1])
    batcher.submit([2])
    errors: list[BaseException] = []

    def submit_late() -> None:
        try:
            batcher.submit([3])
        except BatcherClosedError as error:
            errors.append(error)

    late = threading.Thread(target=submit_late)
    late.start()
    time.sleep(0.05)
    closer = threading.Thread(target=batcher.close, kwargs={"timeout": RESULT_TIMEOUT})
    closer.start()
    late.join(RESULT_TIMEOUT)
    gate.set()
    closer.join(RESULT_TIMEOUT)
    assert len(errors) == 1


def test_skipped_rows_stop_the_wait_at_once(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    with batcher.expect(3) as announced:
        started = time.monotonic()
        future = announced.submit([1])
        announced.skip(2)  # e.g. both found in the content cache
        assert future.result(timeout=RESULT_TIMEOUT) == [2]
        assert time.monotonic() - started < 1.0
        announced.skip(5)  # more than announced: harmless
    assert batcher._intake.announced == 0


def test_withdraw_takes_back_the_rows_no_batch_has_taken(make_batcher) -> None:
    """A cancel: the block in the running batch finishes; a block cut across the next batch
    keeps the rows taken and loses the rest; a block still queued is answered at once, every
    row withdrawn — and the runner never sees the withdrawn rows."""
    release = threading.Event()
    fn = Recorder(lambda rows: release.wait(RESULT_TIMEOUT) and [x * 2 for x in rows])
    batcher = make_batcher(fn, max_batch=2, max_delay_s=0.0)
    with batcher.expect(6) as announced:
        running = announced.submit([1, 2])
        wait_until(lambda: fn.sizes == [2])  # the first batch is in the engine
        later = announced.submit([3, 4, 5])
        queued = announced.submit([6])
        withdrawn = announced.withdraw()
        assert withdrawn == {later: 0, queued: 0}
        assert queued.result(timeout=RESULT_TIMEOUT)[0].args == ("The job was cancelled.",)
        release.set()
        assert running.result(timeout=RESULT_TIMEOUT) == [2, 4]
        assert all(isinstance(r, WithdrawnError) for r in later.result(timeout=RESULT_TIMEOUT))
    time.sleep(0.1)
    assert fn.calls == [[1, 2]]


def test_withdraw_keeps_the_rows_a_batch_already_took(make_batcher) -> None:
    release = threading.Event()
    fn = Recorder(lambda rows: release.wait(RESULT_TIMEOUT) and [x * 2 for x in rows])
    batcher = make_batcher(fn, max_batch=2, max_delay_s=0.0)
    with batcher.expect(3) as announced:
        block = announced.submit([1, 2, 3])
        wait_until(lambda: fn.sizes == [2])  # rows 0-1 taken, row 2 still queued
        assert announced.withdraw() == {block: 2}
        assert not block.done()  # its first rows are still in the engine
        release.set()
        answer = block.result(timeout=RESULT_TIMEOUT)
    assert answer[:2] == [2, 4] and isinstance(answer[2], WithdrawnError)
    assert batcher.snapshot().rows == 2


def test_a_submitter_waiting_for_room_gives_up_when_told(make_batcher) -> None:
    release = threading.Event()
    fn = Recorder(lambda rows: release.wait(RESULT_TIMEOUT) and [x * 2 for x in rows])
    batcher = make_batcher(fn, max_batch=1, max_delay_s=0.0, max_queued=1)
    stop = threading.Event()
    with batcher.expect(3) as announced:
        announced.submit([1])
        wait_until(lambda: fn.sizes == [1])
        announced.submit([2])  # fills the queue
        threading.Timer(0.2, stop.set).start()
        started = time.monotonic()
        assert announced.submit_unless([3], stop.is_set) is None
        assert time.monotonic() - started < 1.5
        release.set()


def wait_until(check: Callable[[], bool], timeout: float = RESULT_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_rows_left_after_a_cut_go_to_another_runner_at_once(make_batcher) -> None:
    """A block of three batches with three runners: they run side by side, not one after
    another (a cut wakes no idle runner, but one more whenever rows are left)."""
    gate = threading.Barrier(3, timeout=RESULT_TIMEOUT)

    def together(rows: list[Any]) -> list[Any]:
        gate.wait()  # each batch waits until all three are running
        return [x * 2 for x in rows]

    fn = Recorder(together)
    batcher = make_batcher(fn, max_batch=2, max_delay_s=5.0, runners=3)
    result = batcher.submit([1, 2, 3, 4, 5, 6]).result(timeout=RESULT_TIMEOUT)
    assert result == [2, 4, 6, 8, 10, 12]
    assert fn.sizes == [2, 2, 2]


def test_a_submitter_waiting_for_room_gets_in_once_a_batch_is_cut(make_batcher) -> None:
    release = threading.Event()

    def held(rows: list[Any]) -> list[Any]:
        release.wait(RESULT_TIMEOUT)
        return rows

    batcher = make_batcher(Recorder(held), max_batch=2, max_delay_s=0.0, max_queued=2)
    first = batcher.submit([1, 2])  # cut at once: the runner holds it
    time.sleep(0.05)
    second = batcher.submit([3, 4])  # queued: the queue is now full
    third: list[Any] = []
    waiter = threading.Thread(target=lambda: third.append(batcher.submit([5, 6])))
    waiter.start()
    time.sleep(0.05)
    assert not third  # no room until a batch is cut
    release.set()
    waiter.join(RESULT_TIMEOUT)
    assert third and third[0].result(timeout=RESULT_TIMEOUT) == [5, 6]
    assert first.result(timeout=RESULT_TIMEOUT) == [1, 2]
    assert second.result(timeout=RESULT_TIMEOUT) == [3, 4]
