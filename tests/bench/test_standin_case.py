"""The `standin` case's figures from the stand-in's reports: pure functions, no runs."""

from __future__ import annotations

from typing import Any

import pytest

from bench.cases import standin
from bench.results import Sized


def _threads(**cpu: float) -> list[dict[str, Any]]:
    return [{"tid": i, "name": name.replace("_", "-"), "cpu_s": s}
            for i, (name, s) in enumerate(cpu.items())]  # fmt: skip


def _edge(t: float, rows: int, forward: float, cpu: float, prep: float, **threads: float) -> Any:
    return {"tick": [t, rows, forward, cpu], "prep_cpu_s": prep, "threads": _threads(**threads)}


def test_thread_names_fall_in_their_groups() -> None:
    names = {
        "ThreadPoolExecutor-0_3": "chunk threads", "batcher-resnet50:1-runner-4": "batcher runners",
        "kiln-prep-collector": "prep collector", "kiln-prep-send-2": "prep senders",
        "resnet50:1-device-fit-0": "stage fit", "detector-host-upload-0": "stage upload",
        "kiln-leases": "lease keeper", "kiln-standin-probe": "stand-in probe", "celery": "other",
    }  # fmt: skip
    assert {name: standin.group_of(name) for name in names} == names


def test_the_window_gives_rate_busy_share_and_cpu_per_row() -> None:
    report = {"window": {
        "first": _edge(10.0, 32, 0.003, 5.0, 1.0, kiln_leases=0.1, kiln_prep_collector=0.2),
        "last": _edge(12.0, 6032, 0.603, 6.2, 2.0, kiln_leases=0.16, kiln_prep_collector=0.5),
    }}  # fmt: skip
    span = standin.window_span(report)
    assert span is not None
    found = standin.figures(span)
    assert found["rows_per_s"] == 3000.0 and found["device_busy_share"] == 0.3
    assert found["engine_cpu_us_per_row"] == pytest.approx(200.0)
    groups = found["engine_cpu_us_per_row_by_group"]
    assert groups["lease keeper"] == pytest.approx(10.0)
    assert groups["prep collector"] == pytest.approx(50.0)
    assert groups["other"] == pytest.approx(140.0)  # what no named group holds
    assert standin.window_span({"window": {"first": report["window"]["first"]}}) is None


def test_a_run_too_short_for_a_window_falls_back_to_the_marginal() -> None:
    def run(items: int, seconds: float, engine: float, forward: float) -> Any:
        report = {"busy_s": {"forward": forward}, "threads": _threads(kiln_leases=engine / 10),
                  "rows": {"forward": items}, "batches": {"forward": items // 32},
                  "stages": [{"thread": "m-device-fit-0", "batches": 2, "sampled": 1,
                              "calls": 12, "handed": 32}]}  # fmt: skip
        return Sized(items, seconds, {"engine": engine, "prep": engine / 2}), report

    result = standin._result("standin-run", "m", run(32, 5.0, 1.0, 0.01), run(64, 5.5, 1.1, 0.02),
                             None)  # fmt: skip
    extra = result.extra
    assert extra["figures_are"] == "marginal over two sizes"
    assert extra["rows_per_s"] == 64.0 and extra["device_busy_share"] == 0.02
    assert extra["engine_cpu_us_per_row"] == pytest.approx(1e6 * 0.1 / 32)
    assert extra["gil_release_points_per_batch"]["m-device-fit-0"]["total"] == 44.0
    assert extra["mean_batch"] == 32.0


def test_the_workers_job_takes_its_own_window_and_its_whole_preps_cpu() -> None:
    def after(rows: int, first: Any, last: Any) -> dict[str, Any]:
        return {"rows": {"forward": rows}, "window": {"first": first, "last": last}}

    small_after = after(3032, _edge(1.0, 32, 0.0, 1.0, 0.0), _edge(2.0, 3032, 0.3, 1.5, 0.0))
    large_after = after(
        9032, _edge(5.0, 3064, 0.31, 2.0, 0.0, kiln_leases=0.0),
        _edge(7.0, 9032, 0.91, 3.8, 0.0, kiln_leases=0.06),
    )  # fmt: skip
    delta = {"rows": {"forward": 6000}, "job_seconds": 2.5, "process_cpu_s": 2.0,
             "prep_cpu_s": 1.2, "busy_s": {"forward": 0.6}, "threads": []}  # fmt: skip
    small = (Sized(3000, 1.2, {}), {}, small_after)
    span = standin._job_window(small, (Sized(6000, 2.5, {}), delta, large_after))
    assert (span.rows, span.seconds) == (5968, 2.0)
    assert span.prep_cpu_s == pytest.approx(1.2 * 5968 / 6000)  # the whole job's, per row
    assert span.groups["lease keeper"] == pytest.approx(0.06)
    # a window that opened before the job (no pause between): the job whole
    stale = after(9032, small_after["window"]["first"], large_after["window"]["last"])
    whole = standin._job_window(small, (Sized(6000, 2.5, {}), delta, stale))
    assert (whole.rows, whole.seconds, whole.engine_cpu_s) == (6000, 2.5, 2.0)
