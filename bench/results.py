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
        cpu = self.cpu_seconds.get("subject")
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


def targets(results: list[CaseResult], models: list[str], max_batch: int) -> list[Target]:
    out = []
    for model in models:
        services = find(results, "services", model)
        paired = services.extra.get("paired_raw_items_per_s") if services else None
        r1 = round(services.items_per_s / paired, 3) if services and paired else None
        out.append(Target(f"R1 {model}: services ÷ raw engine", r1, "≥ 0.90", _ge(r1, 0.90)))
        r2 = ratio(services, find(results, "ray", model))
        out.append(Target(f"R2 {model}: services ÷ Ray Data", r2, "≥ 1.3", _ge(r2, 1.3)))
    ceiling = find(results, "ceiling", "null")
    rate = round(ceiling.items_per_s, 1) if ceiling else None
    out.append(Target("null-model ceiling, items/s", rate, "≥ 2000", _ge(rate, 2000)))
    cpu = ceiling.subject_cpu_ms_per_item if ceiling else None
    cpu = round(cpu, 3) if cpu is not None else None
    out.append(Target("ceiling: Kiln CPU ms per item", cpu, "≤ 0.5", _le(cpu, 0.5)))
    for case, label in (
        ("streaming-capacity", "saturated (closed loop)"),
        ("streaming-100", "at 100% of capacity (open loop)"),
    ):
        full = next((r for r in results if r.case == case and not r.skipped), None)
        mean = full.extra.get("mean_batch") if full else None
        share = round(mean / max_batch, 3) if mean is not None else None
        name = f"streaming {label}: mean batch ÷ max_batch"
        out.append(Target(name, share, "≥ 0.8", _ge(share, 0.8)))
    idle = next((r for r in results if r.case == "idle" and not r.skipped), None)
    if idle:
        budget = idle.extra["engine_batch1_ms"] + 30
        p50 = idle.latency_ms.get("p50")
        out.append(
            Target(
                f"idle submit→result p50 ms (budget {budget:.0f})",
                p50,
                "≤ engine b1 + 30",
                _le(p50, budget),
            )
        )
    return out


def _ge(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def _le(value: float | None, goal: float) -> bool | None:
    return None if value is None else value <= goal
