"""What one case measured, and the ratios the issue's targets are stated in."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.measure import Usage


@dataclass
class CaseResult:
    case: str
    model: str
    items: int = 0
    seconds: float = 0.0
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    @property
    def subject_cpu_ms_per_item(self) -> float | None:
        return self.cpu_ms_per_item("subject")

    def cpu_ms_per_item(self, group: str) -> float | None:
        """CPU ms per item of one metered group ("subject", "services", "moto", "driver")."""
        cpu = self.cpu_seconds.get(group)
        return 1000 * cpu / self.items if cpu is not None and self.items else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "items_per_s": round(self.items_per_s, 2)}

    @classmethod
    def from_usage(cls, case: str, model: str, items: int, usage: Usage, **kw: Any) -> CaseResult:
        return cls(
            case,
            model,
            items=items,
            seconds=round(usage.seconds, 3),
            cpu_seconds=usage.cpu_seconds,
            peak_rss_mb=usage.peak_rss_mb,
            **kw,
        )

    @classmethod
    def skip(cls, case: str, model: str, reason: str) -> CaseResult:
        return cls(case, model, skipped=reason)


@dataclass(frozen=True)
class Sized:
    """One run of a subject at one size (the `feed` case): items, wall seconds, and CPU seconds
    per metered group. Two of them make a marginal result."""

    items: int
    seconds: float
    cpu_seconds: dict[str, float]


def marginal(
    case: str, model: str, small: Sized, large: Sized, extra: dict[str, Any] | None = None
) -> CaseResult:
    """The subject's marginal figures: (n_large − n_small) items in (t_large − t_small)
    seconds, and each group's CPU likewise, so start-up and model load cancel. Both runs are
    kept in `extra`. The larger run may not be the slower one at tiny sizes (noise): seconds
    ≤ 0 then, and the rate reads 0 (`marginal_rate` None)."""
    seconds = round(large.seconds - small.seconds, 3)
    cpu = {
        group: round(value - small.cpu_seconds.get(group, 0.0), 3)
        for group, value in large.cpu_seconds.items()
    }
    return CaseResult(
        case,
        model,
        items=large.items - small.items,
        seconds=seconds,
        cpu_seconds=cpu,
        extra={"small": asdict(small), "large": asdict(large), **(extra or {})},
    )


def marginal_rate(result: CaseResult | None) -> float | None:
    """A marginal result's items/s, None where it could not be measured (seconds ≤ 0)."""
    if result is None or result.items <= 0 or result.seconds <= 0:
        return None
    return result.items_per_s


def find(results: list[CaseResult], case: str, model: str) -> CaseResult | None:
    for result in results:
        if result.case == case and result.model == model and not result.skipped:
            return result
    return None


def ratio(a: CaseResult | None, b: CaseResult | None) -> float | None:
    if a is None or b is None or not b.items_per_s:
        return None
    return round(a.items_per_s / b.items_per_s, 3)


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    goal: str
    met: bool | None
    informational: bool = False  # shown beside a target (the moto variant), no goal of its own


# Issue 15's per-model targets name these two; other models get no row.
TARGET_MODELS = ("resnet18", "detector")


def targets(results: list[CaseResult], models: list[str], max_batch: int) -> list[Target]:
    """Issue 15's targets, issue 23's (`feed`) and issue 32's (`startup`), as far as this run
    measured them: a row that cannot be computed (its case not run, skipped or failed) is left
    out, never guessed.
    `models`: the run's models; the per-model rows are for those of TARGET_MODELS, and any
    other case that measured one of them (a detector case added beside the plan's models)."""
    chosen = [m for m in TARGET_MODELS if m in models or any(r.model == m for r in results)]
    rows = [
        *_ceiling(results),
        *(row for model in chosen for row in _per_model(results, model)),
        *_one_image(results, max_batch),
        *_big_job(results),
        *_feed(results),
        *_video(results),
        *_startup(results),
    ]
    return [row for row in rows if row.value is not None]


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _ceiling(results: list[CaseResult]) -> list[Target]:
    """T1: the null-model ceiling on local storage, and the moto variant beside it."""
    local, moto = find(results, "ceiling-local", "null"), find(results, "ceiling", "null")
    rows = [
        Target(
            "T1 ceiling-local: items/s",
            _rounded(local.items_per_s, 1) if local else None,
            "≥ 2000",
            _ge(local.items_per_s if local else None, 2000),
        ),
    ]
    for group, label, goal in (("subject", "Kiln CPU", 0.4), ("services", "Postgres+Redis", 0.25)):
        value = _rounded(local.cpu_ms_per_item(group)) if local else None
        rows.append(
            Target(f"T1 ceiling-local: {label} ms/item", value, f"≤ {goal}", _le(value, goal))
        )
    if moto:
        rows.append(_info("T1 ceiling (moto S3): items/s", _rounded(moto.items_per_s, 1)))
        for group, label in (
            ("subject", "Kiln CPU"),
            ("services", "Postgres+Redis"),
            ("moto", "moto S3 server"),
        ):
            value = _rounded(moto.cpu_ms_per_item(group))
            rows.append(_info(f"T1 ceiling (moto S3): {label} ms/item", value))
    return rows


def _per_model(results: list[CaseResult], model: str) -> list[Target]:
    """T2 (Kiln beats a for-loop and nears the raw engine) and T3 (beats Ray Data, Daft)."""
    services = find(results, "services", model)
    rows = [
        _ratio_row(f"T2 {model}: services ÷ loop", services, find(results, "loop", model), 1.10)
    ]
    for case, label, goal in (("services-local", "local", 0.85), ("services", "moto S3", 0.80)):
        kiln = find(results, case, model)
        paired = kiln.extra.get("paired_raw_items_per_s") if kiln else None
        value = _rounded(kiln.items_per_s / paired) if kiln and paired else None
        rows.append(
            Target(
                f"T2 {model}: {case} ÷ raw engine ({label})", value, f"≥ {goal}", _ge(value, goal)
            )
        )
    rows.append(
        _ratio_row(f"T3 {model}: services ÷ Ray Data", services, find(results, "ray", model), 2.0)
    )
    rows.append(
        _ratio_row(f"T3 {model}: services ÷ Daft", services, find(results, "daft", model), 1.5)
    )
    return rows


def _ratio_row(name: str, a: CaseResult | None, b: CaseResult | None, goal: float) -> Target:
    value = ratio(a, b)
    return Target(name, value, f"≥ {goal:.2f}", _ge(value, goal))


def _one_image(results: list[CaseResult], max_batch: int) -> list[Target]:
    """T4: one-image jobs, idle latency against the engine alone, and batches when saturated."""
    rows = []
    idle = _first(results, "idle")
    batch1 = idle.extra.get("engine_batch1_ms") if idle else None
    if idle and batch1 is not None:
        budget = batch1 + 15
        p50 = idle.latency_ms.get("p50")
        rows.append(
            Target(
                f"T4 idle submit→result p50 ms (budget {budget:.0f})",
                p50,
                "≤ engine b1 + 15",
                _le(p50, budget),
            )
        )
    saturated = _first(results, "streaming-capacity")
    mean = saturated.extra.get("mean_batch") if saturated else None
    share = round(mean / max_batch, 3) if mean is not None else None
    rows.append(
        Target("T4 streaming saturated: mean batch ÷ max_batch", share, "≥ 0.8", _ge(share, 0.8))
    )
    return rows


def _big_job(results: list[CaseResult]) -> list[Target]:
    """T5: a 1,000,000-item job: polls stay fast, chunks never queue on the job row."""
    big = find(results, "bigjob", "null")
    if big is None:
        return []
    p99 = big.latency_ms.get("p99")
    waits = big.extra.get("job_row_wait_share")
    return [
        Target("T5 bigjob: GET /v1/jobs/{id} p99 ms", p99, "≤ 25", _le(p99, 25)),
        Target(
            "T5 bigjob: share of samples a worker waits on the job row", waits, "= 0", _le(waits, 0)
        ),
        _info("T5 bigjob: items finished/s while polled", big.extra.get("items_finished_per_s")),
        _info(
            "T5 bigjob: share of samples a worker waits on any lock",
            big.extra.get("lock_wait_share"),
        ),
    ]


def _first(results: list[CaseResult], case: str) -> CaseResult | None:
    return next((r for r in results if r.case == case and not r.skipped), None)


def _info(name: str, value: float | None) -> Target:
    return Target(name, value, "–", None, informational=True)


def _ge(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _le(value: float | None, goal: float) -> bool | None:
    return None if value is None else value <= goal


FEED_MODEL = "null224"


def _feed(results: list[CaseResult]) -> list[Target]:
    """F1–F3 (issue 23): how well Kiln feeds an engine that costs nothing, from marginal rates."""
    embedded = find(results, "feed-embedded", FEED_MODEL)
    one_prep = find(results, "feed-embedded-1prep", FEED_MODEL)
    worker, peer = find(results, "feed-worker", FEED_MODEL), find(results, "feed-peer", FEED_MODEL)
    decode = find(results, "feed-decode-fit", FEED_MODEL)
    decode_ms = decode.cpu_ms_per_item("subject") if decode else None
    rows = [
        _feed_ratio("F1 feed: kiln run ÷ DataLoader peer (marginal)", embedded, peer, 1.0),
        _feed_ratio("F1 feed: kiln worker ÷ DataLoader peer (marginal)", worker, peer, 1.0),
        _feed_ratio("F2 feed: 2 prep processes ÷ 1", embedded, one_prep, 1.7),
    ]
    engine = _rounded(_marginal_cpu(embedded, "engine"))
    rows.append(
        Target("F3 feed: engine-process CPU ms/item (kiln run)", engine, "≤ 0.1", _le(engine, 0.1))
    )
    for label, subject in (("kiln run", embedded), ("kiln worker", worker)):
        kiln = _marginal_cpu(subject, "subject")
        outside = _rounded(kiln - decode_ms) if kiln is not None and decode_ms is not None else None
        rows.append(
            Target(
                f"F3 feed: Kiln CPU ms/item outside decode + fit ({label})",
                outside,
                "≤ 0.3",
                _le(outside, 0.3),
            )
        )
    rows.append(_info("F feed: decode + fit CPU ms/image (one core)", _rounded(decode_ms)))
    for subject in (s for s in (embedded, one_prep, worker, peer) if s is not None):
        rate = _rounded(marginal_rate(subject), 1)
        rows.append(_info(f"F feed: {subject.case} items/s (marginal)", rate))
    return rows


def _feed_ratio(name: str, a: CaseResult | None, b: CaseResult | None, goal: float) -> Target:
    """a ÷ b of marginal rates; no value where either could not be measured."""
    rate_a, rate_b = marginal_rate(a), marginal_rate(b)
    value = _rounded(rate_a / rate_b) if rate_a and rate_b else None
    return Target(name, value, f"≥ {goal:.1f}", _ge(value, goal))


def _marginal_cpu(result: CaseResult | None, group: str) -> float | None:
    """A marginal result's CPU ms per item of `group`, None where its rate is not measured."""
    if marginal_rate(result) is None:
        return None
    assert result is not None
    return result.cpu_ms_per_item(group)


def _video(results: list[CaseResult]) -> list[Target]:
    """V (the `video` case, bench/video.py): `kiln run` ÷ a plain PyAV loop, sampled frames per
    second, per row (model, sampling rate and clip length in its name)."""
    rows = []
    for kiln in (r for r in results if r.case == "video-kiln" and not r.skipped):
        peer = find(results, "video-peer", kiln.model)
        rows.append(_ratio_row(f"V video {kiln.model}: kiln run ÷ PyAV loop", kiln, peer, 1.2))
    return rows


def _startup(results: list[CaseResult]) -> list[Target]:
    """S (issue 32): start-up a user does not notice (bench/cases/startup.py)."""
    row = find(results, "startup", "null")
    if row is None:
        return []
    help_s, prep_s = row.extra.get("help_s"), row.extra.get("prep_ready_s")
    after = row.extra.get("first_result_after_engine_s")
    return [
        Target("S startup: kiln run --help s", help_s, "≤ 0.5", _le(help_s, 0.5)),
        Target("S startup: a prep process ready s", prep_s, "≤ 1", _le(prep_s, 1.0)),
        Target("S startup: first result after the engine is ready s", after, "≤ 3", _le(after, 3)),
        _info(f"S startup: kiln run of {row.items} images, wall s", row.seconds),
        _info(
            "S startup: first result, s from the command's start", row.extra.get("first_result_s")
        ),
    ]
