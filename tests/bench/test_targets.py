"""Issue 15's target rows from case results, and the CPU column: pure functions, no services."""

from __future__ import annotations

from bench.report import _cpu, _verdict
from bench.results import CaseResult, targets


def _case(case: str, model: str, items: int, seconds: float, **kw: object) -> CaseResult:
    return CaseResult(case, model, items=items, seconds=seconds, **kw)  # type: ignore[arg-type]


def test_rows_that_cannot_be_computed_are_left_out() -> None:
    assert targets([], ["resnet18"], 16) == []
    only_ray = [_case("ray", "resnet18", 100, 1.0)]
    assert targets(only_ray, ["resnet18"], 16) == []


def test_ceiling_local_is_judged_and_moto_is_reported_beside_it() -> None:
    local = _case("ceiling-local", "null", 4000, 2.0, cpu_seconds={"subject": 1.2, "services": 0.8})
    moto = _case(
        "ceiling", "null", 1000, 2.0, cpu_seconds={"subject": 2.0, "services": 0.5, "moto": 1.5}
    )
    rows = {t.name: t for t in targets([local, moto], ["resnet18"], 16)}
    assert rows["T1 ceiling-local: items/s"].value == 2000.0
    assert rows["T1 ceiling-local: items/s"].met is True
    assert rows["T1 ceiling-local: Kiln CPU ms/item"].value == 0.3
    assert rows["T1 ceiling-local: Postgres+Redis ms/item"].met is True  # 0.2 ≤ 0.25
    beside = rows["T1 ceiling (moto S3): moto S3 server ms/item"]
    assert beside.value == 1.5 and beside.informational
    assert _verdict(beside) == "reported"


def test_per_model_ratios_and_big_job() -> None:
    services = _case("services", "resnet18", 110, 1.0, extra={"paired_raw_items_per_s": 125.0})
    results = [
        services,
        _case("loop", "resnet18", 100, 1.0),
        _case("ray", "resnet18", 50, 1.0),
        _case(
            "bigjob", "null", 900, 1.0, latency_ms={"p50": 5.0, "p99": 30.0},
            extra={"job_row_wait_share": 0.0, "items_finished_per_s": 900.0},
        ),
    ]  # fmt: skip
    rows = {t.name: t for t in targets(results, ["resnet18"], 16)}
    assert rows["T2 resnet18: services ÷ loop"].value == 1.1
    assert rows["T2 resnet18: services ÷ raw engine (moto S3)"].value == 0.88
    assert rows["T3 resnet18: services ÷ Ray Data"].met is True
    assert "T3 resnet18: services ÷ Daft" not in rows  # no daft case in this run
    assert "T2 resnet18: services-local ÷ raw engine (local)" not in rows
    assert rows["T5 bigjob: GET /v1/jobs/{id} p99 ms"].met is False
    assert rows["T5 bigjob: share of samples a worker waits on the job row"].met is True


def test_idle_without_an_engine_figure_has_no_row() -> None:
    idle = _case("idle", "resnet18", 3, 0.2, latency_ms={"p50": 40.0, "p99": 50.0},
                 extra={"engine_batch1_ms": None})  # fmt: skip
    assert targets([idle], ["resnet18"], 16) == []
    idle.extra["engine_batch1_ms"] = 20.0
    [row] = targets([idle], ["resnet18"], 16)
    assert row.met is False  # 40 > 20 + 15


def test_cpu_column_marks_an_unmetered_moto() -> None:
    assert _cpu({"subject": 1.0}) == "1.0"
    assert _cpu({"subject": 1.0, "services": 0.5, "driver": 0.1}) == "1.0/0.5/–/0.1"
    assert _cpu({"subject": 1.0, "services": 0.5, "moto": 2.0, "driver": 0.1}) == "1.0/0.5/2.0/0.1"
