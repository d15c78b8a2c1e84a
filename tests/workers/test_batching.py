"""The Batcher on its own: batch release rules, futures, bisection, close, stats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kiln.app.core.errors import KilnError
from kiln.workers.batching import Batcher, BatcherClosedError

RESULT_TIMEOUT = 2.0


class Recorder:
    """A batch function that records every batch it is given."""

    def __init__(self, fn: Callable[[Sequence[Any]], Sequence[Any]] | None = None) -> None:
        self.fn = fn or (lambda rows: [x * 2 for x in rows])
        self.calls: list[list[Any]] = []
        self._lock = threading.Lock()

    def __call__(self, rows: Sequence[Any]) -> Sequence[Any]:
        with self._lock:
            self.calls.append(list(rows))
        return self.fn(rows)

    @property
    def sizes(self) -> list[int]:
        with self._lock:
            return [len(c) for c in self.calls]


@pytest.fixture
def make_batcher() -> Iterator[Callable[..., Batcher[Any, Any]]]:
    made: list[Batcher[Any, Any]] = []

    def make(fn: Callable[[Sequence[Any]], Sequence[Any]], **kwargs: Any) -> Batcher[Any, Any]:
        batcher: Batcher[Any, Any] = Batcher(fn, **kwargs)
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
        Batcher(lambda rows: rows, **kwargs)


def test_full_batch_is_released_without_waiting_for_the_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=5.0)
    started = time.monotonic()
    futures = batcher.submit_many([1, 2, 3, 4])
    results = [f.result(timeout=RESULT_TIMEOUT) for f in futures]
    elapsed = time.monotonic() - started
    assert results == [2, 4, 6, 8]
    assert elapsed < 0.5, f"a full batch waited {elapsed:.3f}s (max_delay is 5s)"
    assert fn.sizes == [4]


def test_partial_batch_is_released_after_max_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=10, max_delay_s=0.05)
    started = time.monotonic()
    futures = batcher.submit_many([1, 2, 3])
    results = [f.result(timeout=RESULT_TIMEOUT) for f in futures]
    elapsed = time.monotonic() - started
    assert results == [2, 4, 6]
    assert fn.sizes == [3]
    assert 0.045 <= elapsed < 0.5


def test_one_future_per_row_with_its_own_result(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=4, max_delay_s=0.01)
    rows = list(range(10))
    futures = batcher.submit_many(rows)
    assert len(futures) == len(rows)
    assert [f.result(timeout=RESULT_TIMEOUT) for f in futures] == [x * 2 for x in rows]
    assert all(size <= 4 for size in fn.sizes)
    assert sorted(x for call in fn.calls for x in call) == rows


def test_a_bad_row_fails_alone_by_bisection(make_batcher) -> None:
    def fn_(rows: Sequence[Any]) -> list[Any]:
        if "bad" in rows:
            raise ValueError("bad row in batch")
        return [f"ok:{r}" for r in rows]

    fn = Recorder(fn_)
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.5)
    rows: list[Any] = [0, 1, 2, 3, 4, "bad", 6, 7]
    futures = batcher.submit_many(rows)

    for row, future in zip(rows, futures, strict=True):
        if row == "bad":
            with pytest.raises(ValueError, match="bad row"):
                future.result(timeout=RESULT_TIMEOUT)
        else:
            assert future.result(timeout=RESULT_TIMEOUT) == f"ok:{row}"

    # Depth first: [0..7] fails → [0..3] ok, [4..7] fails → [4, bad] fails → [4] ok,
    # [bad] fails → [6, 7] ok. Failures at sizes 8, 4, 2 and 1.
    assert fn.calls == [rows, rows[:4], rows[4:], [4, "bad"], [4], ["bad"], [6, 7]]
    assert batcher.stats.failed_batches == 4
    assert batcher.stats.batches == 1
    assert batcher.stats.rows == 8


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

    def fn_(rows: Sequence[Any]) -> list[Any]:
        if len(rows) > 2:
            raise oom(len(rows))
        return [r * 10 for r in rows]

    fn = Recorder(fn_)
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.5)
    assert [f.result(RESULT_TIMEOUT) for f in batcher.submit_many(range(8))] == [
        r * 10 for r in range(8)
    ]
    assert fn.sizes[:3] == [8, 4, 2]  # halved until it fits
    assert batcher.max_batch == 2
    assert batcher.stats.out_of_memory == 2  # the batches of 8 and 4

    fn.calls.clear()
    assert [f.result(RESULT_TIMEOUT) for f in batcher.submit_many(range(6))] == [
        r * 10 for r in range(6)
    ]
    assert max(fn.sizes) <= 2 and batcher.stats.out_of_memory == 2


def test_an_ordinary_error_does_not_lower_the_cap(make_batcher) -> None:
    def fn_(rows: Sequence[Any]) -> list[Any]:
        if "bad" in rows:
            raise ValueError("bad row")
        return list(rows)

    batcher = make_batcher(fn_, max_batch=4, max_delay_s=0.5)
    futures = batcher.submit_many([1, "bad", 3, 4])
    for future in futures:
        future.exception(RESULT_TIMEOUT)
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
    futures = batcher.submit_many([1, 2, 3, 4])
    for future in futures:
        with pytest.raises(RuntimeError, match=r"returned \d+ results for 1 rows"):
            future.result(timeout=RESULT_TIMEOUT)
    assert batcher.stats.failed_batches > 0


def test_cancelled_rows_are_not_sent_to_the_engine(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=10, max_delay_s=0.2)
    futures = batcher.submit_many([1, 2, 3])
    assert futures[1].cancel()
    assert futures[0].result(timeout=RESULT_TIMEOUT) == 2
    assert futures[2].result(timeout=RESULT_TIMEOUT) == 6
    assert futures[1].cancelled()
    assert fn.calls == [[1, 3]]


def test_submit_after_close_raises() -> None:
    batcher: Batcher[int, int] = Batcher(lambda rows: rows, max_batch=2, max_delay_s=0.01)
    batcher.close()
    with pytest.raises(BatcherClosedError) as caught:
        batcher.submit(1)
    assert isinstance(caught.value, KilnError)  # a sentence Kiln raised on purpose
    assert str(caught.value).endswith("is closed.")
    with pytest.raises(BatcherClosedError):
        batcher.submit_many([1, 2])
    batcher.close()  # a second close is harmless


def test_close_drains_queued_rows_without_waiting_out_the_delay() -> None:
    fn = Recorder()
    batcher: Batcher[int, int] = Batcher(fn, max_batch=100, max_delay_s=5.0, runners=2)
    futures = batcher.submit_many([1, 2, 3, 4, 5])
    started = time.monotonic()
    batcher.close(timeout=2.0)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0
    assert all(f.done() for f in futures)
    assert [f.result(timeout=0) for f in futures] == [2, 4, 6, 8, 10]
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
    def slow(rows: Sequence[int]) -> list[int]:
        time.sleep(0.1)
        return list(rows)

    batcher = make_batcher(slow, max_batch=1, max_delay_s=0.0, runners=2)
    started = time.monotonic()
    futures = batcher.submit_many([1, 2])
    assert [f.result(timeout=RESULT_TIMEOUT) for f in futures] == [1, 2]
    elapsed = time.monotonic() - started
    assert elapsed < 0.18, f"two 0.1s batches on two runners took {elapsed:.3f}s"
    assert batcher.stats.batches == 2


def test_stats_count_sizes_and_mean(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=3, max_delay_s=0.1)
    assert batcher.stats.mean_batch == 0.0
    futures = batcher.submit_many(list(range(7)))
    for future in futures:
        future.result(timeout=RESULT_TIMEOUT)
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


def test_greedy_runs_a_lone_row_at_once(make_batcher) -> None:
    """Nothing else is announced: an interactive row does not wait out the delay."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    started = time.monotonic()
    assert batcher.submit(1).result(timeout=RESULT_TIMEOUT) == 2
    assert time.monotonic() - started < 1.0


def test_greedy_waits_for_announced_rows(make_batcher) -> None:
    """A chunk announces its rows and submits them as it decodes them: one batch."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    with batcher.expect(3) as announced:
        futures = [announced.submit(1)]
        time.sleep(0.1)  # decoding the next input
        futures += [announced.submit(2), announced.submit(3)]
        assert [f.result(timeout=RESULT_TIMEOUT) for f in futures] == [2, 4, 6]
    assert fn.sizes == [3]


def test_greedy_stops_waiting_when_announced_rows_are_written_off(make_batcher) -> None:
    """The last input failed to decode: its row never comes, and the batch goes at once."""
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=5.0, greedy=True)
    started = time.monotonic()
    with batcher.expect(2) as announced:
        future = announced.submit(1)
    assert future.result(timeout=RESULT_TIMEOUT) == 2
    assert time.monotonic() - started < 1.0


def test_greedy_still_caps_the_wait_at_max_delay(make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch=8, max_delay_s=0.05, greedy=True)
    with batcher.expect(2) as announced:
        started = time.monotonic()
        assert announced.submit(1).result(timeout=RESULT_TIMEOUT) == 2
        assert 0.045 <= time.monotonic() - started < 1.0
    assert fn.sizes == [1]


def test_max_queued_makes_submit_wait_for_the_engine(make_batcher) -> None:
    gate = threading.Event()

    def slow(rows: Sequence[int]) -> list[int]:
        gate.wait(RESULT_TIMEOUT)
        return list(rows)

    batcher = make_batcher(slow, max_batch=1, max_delay_s=0.0, max_queued=2)
    batcher.submit_many([1])  # taken by the runner, which blocks on the gate
    time.sleep(0.05)
    batcher.submit_many([2, 3])  # fills the queue
    blocked = threading.Thread(target=batcher.submit, args=(4,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive(), "submit should wait while the queue is full"
    gate.set()
    blocked.join(RESULT_TIMEOUT)
    assert not blocked.is_alive()


def test_close_releases_a_blocked_submitter(make_batcher) -> None:
    gate = threading.Event()
    batcher = make_batcher(
        lambda rows: gate.wait(RESULT_TIMEOUT) and list(rows),
        max_batch=1,
        max_delay_s=0.0,
        max_queued=1,
    )
    batcher.submit_many([1, 2])
    errors: list[BaseException] = []

    def submit_late() -> None:
        try:
            batcher.submit(3)
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
        future = announced.submit(1)
        announced.skip(2)  # e.g. both found in the content cache
        assert future.result(timeout=RESULT_TIMEOUT) == 2
        assert time.monotonic() - started < 1.0
        announced.skip(5)  # more than announced: harmless
    assert batcher._announced == 0
