"""Target rows (issues 15 and 23) from case results, and the CPU column: pure functions."""

from __future__ import annotations

from bench.report import _cpu, _verdict
from bench.results import CaseResult, Sized, marginal, marginal_rate, targets


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


def test_marginal_rate_cancels_start_up() -> None:
    small = Sized(500, 3.0, {"subject": 4.0, "engine": 3.5})
    large = Sized(1000, 4.0, {"subject": 6.5, "engine": 4.0})
    result = marginal("feed-embedded", "null224", small, large, {"settings": {}})
    assert (result.items, result.seconds) == (500, 1.0)
    assert result.items_per_s == marginal_rate(result) == 500.0  # not 1000 / 4.0 = 250
    assert result.cpu_seconds == {"subject": 2.5, "engine": 0.5}
    assert result.cpu_ms_per_item("engine") == 1.0
    assert result.extra["small"] == {"items": 500, "seconds": 3.0, "cpu_seconds": small.cpu_seconds}
    assert result.extra["settings"] == {}
    noise = marginal("feed-peer", "null224", Sized(8, 0.2, {}), Sized(16, 0.19, {}))
    assert noise.seconds < 0 and marginal_rate(noise) is None  # not a rate: no ratio from it


def _feed(case: str, items: int, seconds: float, **cpu: float) -> CaseResult:
    return _case(case, "null224", items, seconds, cpu_seconds={"subject": 0.0, **cpu})


def test_feed_rows() -> None:
    results = [
        _feed("feed-embedded", 2000, 4.0, subject=3.6, engine=0.1, children=3.5),  # 500/s
        _feed("feed-embedded-1prep", 2000, 8.0, subject=3.5),  # 250/s
        _feed("feed-worker", 2000, 5.0, subject=4.8, services=0.2, driver=0.1),  # 400/s
        _feed("feed-peer", 2000, 4.4),  # 454.5/s
        _feed("feed-decode-fit", 400, 0.7, subject=0.6),  # 1.5 ms/image
    ]
    rows = {t.name: t for t in targets(results, ["resnet18"], 16)}
    assert rows["F1 feed: kiln run ÷ DataLoader peer (marginal)"].value == 1.1
    assert rows["F1 feed: kiln run ÷ DataLoader peer (marginal)"].met is True
    assert rows["F1 feed: kiln worker ÷ DataLoader peer (marginal)"].met is False  # 0.88
    assert rows["F2 feed: 2 prep processes ÷ 1"].value == 2.0
    engine = rows["F3 feed: engine-process CPU ms/item (kiln run)"]
    assert (engine.value, engine.met) == (0.05, True)
    outside = rows["F3 feed: Kiln CPU ms/item outside decode + fit (kiln run)"]
    assert (outside.value, outside.met) == (0.3, True)  # 1.8 − 1.5
    outside = rows["F3 feed: Kiln CPU ms/item outside decode + fit (kiln worker)"]
    assert (outside.value, outside.met) == (0.9, False)  # 2.4 − 1.5
    assert rows["F feed: decode + fit CPU ms/image (one core)"].informational
    assert rows["F feed: feed-peer items/s (marginal)"].value == 454.5


def test_feed_rows_without_a_marginal_rate_are_left_out() -> None:
    results = [
        _feed("feed-embedded", 8, -0.01, subject=0.01, engine=0.01),  # smaller run was slower
        _feed("feed-peer", 8, 0.05),
    ]
    names = {t.name for t in targets(results, ["resnet18"], 16)}
    assert names == {"F feed: feed-peer items/s (marginal)"}


def test_startup_rows() -> None:
    startup = _case(
        "startup", "null", 32, 4.0,
        extra={"help_s": 0.3, "prep_ready_s": 1.2, "first_result_after_engine_s": 0.8,
               "first_result_s": 2.5},
    )  # fmt: skip
    rows = {t.name: t for t in targets([startup], ["resnet18"], 16)}
    assert rows["S startup: kiln run --help s"].met is True
    assert rows["S startup: a prep process ready s"].met is False
    assert rows["S startup: first result after the engine is ready s"].met is True
    assert rows["S startup: kiln run of 32 images, wall s"].value == 4.0
    assert rows["S startup: first result, s from the command's start"].informational
