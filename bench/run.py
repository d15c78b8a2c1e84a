"""Prepare inputs and models, start the services, run the cases in order, collect results."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from bench.cases import (
    bigjob,
    builtins,
    daft_case,
    embedded,
    feed,
    loop,
    naive_celery,
    raw,
    ray_data,
    services,
    standin,
    startup,
    streaming,
    video,
)
from bench.context import Context
from bench.inputs import make_images
from bench.models import BUILTIN_MODELS, detector_model, export_resnet, labels, null_model
from bench.plan import MODEL_CASES, PAIRED, Plan
from bench.results import FEED_MODEL, CaseResult
from bench.stack import Registered, Stack, kiln_stack

log = logging.getLogger(__name__)

CaseFn = Callable[[Context, str], CaseResult]
MODEL_CASE_FNS: dict[str, CaseFn] = {
    "raw": raw.run,
    "loop": loop.run,
    "embedded": embedded.run,
    "services": services.run,
    "naive-celery": naive_celery.run,
    "ray": ray_data.run,
    "daft": daft_case.run,
}
RESNET_INPUT = 224
# Not for built-ins: `embedded` registers the model itself, `naive-celery` feeds ImageNet crops.
REGISTERED_ONLY = {"embedded", "naive-celery"}


def prepare(plan: Plan, workdir: Path, console: Console) -> Context:
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    w, h = plan.size
    with console.status(f"generating {plan.images} JPEGs of {w}×{h} (cached)…"):
        images = make_images(workdir / "images" / f"{w}x{h}-n{plan.images}", plan.images, plan.size)
    small: list[Path] = []
    if {"ceiling", "ceiling-local"} & set(plan.cases):
        sw, sh = plan.ceiling_size
        count = max(plan.ceiling_items, plan.ceiling_local_items)
        folder = workdir / "images" / f"{sw}x{sh}-n{count}"
        with console.status(f"generating {count} small JPEGs (cached)…"):
            small = make_images(folder, count, plan.ceiling_size)
    models: dict[str, Registered] = {}
    for name in plan.models:
        if name in BUILTIN_MODELS:  # Kiln ships it: nothing to export or register
            path, side, names = detector_model()
            models[name] = Registered(name, path, side, names)
            continue
        with console.status(f"exporting {name} with torch (cached)…"):
            path = export_resnet(
                int(name.removeprefix("resnet")), workdir / "models" / f"{name}.onnx"
            )
        models[name] = Registered(name, path, RESNET_INPUT, labels(1000))
    side = plan.ceiling_size[1]
    models["null"] = Registered(
        "null", null_model(workdir / "models" / f"null-{side}.onnx", side), side, labels(3)
    )
    return Context(plan, workdir, log_dir, images, small, models)


@contextmanager
def services_for(ctx: Context, console: Console) -> Iterator[Stack | None]:
    if not ctx.plan.needs_stack:
        yield None
        return
    with console.status("starting Postgres database, Redis index, moto S3, kiln api + worker…"):
        stack_cm = kiln_stack(ctx.log_dir, dict(ctx.plan.kiln_env))
        stack = stack_cm.__enter__()
    try:
        with console.status("uploading inputs to S3 and registering models…"):
            ctx.uris["images"] = stack.upload(f"images-{len(ctx.images)}", ctx.images)
            if "ceiling" in ctx.plan.cases:
                small = ctx.small_images[: ctx.plan.ceiling_items]
                ctx.uris["small"] = stack.upload(f"small-{len(small)}", small)
            for model in ctx.models.values():
                if model.name not in BUILTIN_MODELS:
                    stack.register(model, ctx.workdir)
        yield stack
    finally:
        stack_cm.__exit__(None, None, None)


class Runner:
    def __init__(self, ctx: Context, console: Console) -> None:
        self.ctx = ctx
        self.console = console
        self.results: list[CaseResult] = []
        self.failures: list[str] = []

    def attempt(self, label: str, fn: Callable[[], list[CaseResult]]) -> list[CaseResult]:
        with self.console.status(f"{label}…"):
            try:
                produced = fn()
            except Exception as error:
                log.debug("case failed", exc_info=True)
                (self.ctx.log_dir / f"failure-{label.replace(' ', '-')}.txt").write_text(
                    traceback.format_exc()
                )
                self.failures.append(f"{label}: {error}")
                self.console.print(f"[red]✗ {label}: {escape(str(error))}[/red]")
                return []
        for result in produced:
            self.results.append(result)
            self.console.print(_line(result))
        return produced

    def model_cases(self, model: str) -> None:
        self.attempt(f"raw {model}", lambda: [raw.run(self.ctx, model)])
        for case in MODEL_CASES[1:]:
            if case in self.ctx.plan.cases:
                self._paired_case(case, model)

    def _paired_case(self, case: str, model: str) -> None:
        if case in REGISTERED_ONLY and model in BUILTIN_MODELS:
            why = f"runs registered models only; `{model}` is built in (see `builtin`)"
            self.attempt(f"{case} {model}", lambda: [CaseResult.skip(case, model, why)])
            return
        pair: list[CaseResult] = []
        if case in PAIRED and model in self.ctx.raw:
            pair = self.attempt(f"raw-paired {model}", lambda: [raw.run(self.ctx, model, True)])
        produced = self.attempt(f"{case} {model}", lambda: [MODEL_CASE_FNS[case](self.ctx, model)])
        if produced and pair and not produced[0].skipped:
            produced[0].extra["paired_raw_items_per_s"] = round(pair[0].items_per_s, 2)

    def global_cases(self) -> None:
        if "startup" in self.ctx.plan.cases:
            self.attempt("startup null", lambda: [startup.run(self.ctx)])
        if "ceiling" in self.ctx.plan.cases:
            self.attempt("ceiling null", lambda: [services.run_ceiling(self.ctx)])
        if "ceiling-local" in self.ctx.plan.cases:
            self.attempt("ceiling-local null", lambda: [services.run_ceiling_local(self.ctx)])
        if "streaming" in self.ctx.plan.cases:
            model = self.ctx.plan.models[0]
            self.attempt(f"streaming {model}", lambda: streaming.run(self.ctx, model))
        if "builtin" in self.ctx.plan.cases:
            self.attempt("built-in models", lambda: builtins.run(self.ctx))
        if "bigjob" in self.ctx.plan.cases:
            self.attempt("bigjob null", lambda: [bigjob.run(self.ctx)])
        self.feed_cases()

    def feed_cases(self) -> None:
        """The cases of how Kiln feeds a device: `feed`, the stand-in's, `video`."""
        if "feed" in self.ctx.plan.cases:
            for subject in feed.SUBJECTS:  # apart: one failing leaves the others' rows
                self._feed(subject)
        if "standin" in self.ctx.plan.cases:
            self.standin_cases()
        if "video" in self.ctx.plan.cases:
            self.video_cases()

    def standin_cases(self) -> None:
        """`kiln run` through the device stand-in for each of its models, a warm worker for
        the first; each apart, so one failing leaves the others' rows."""
        models = self.ctx.plan.standin_models
        for model in models:
            self._standin("standin-run", model)
        if models:
            self._standin("standin-worker", models[0])

    def _standin(self, subject: str, model: str) -> None:
        self.attempt(f"{subject} {model}", lambda: [standin.run(self.ctx, subject, model)])

    def video_cases(self) -> None:
        """Each row's peer, then `kiln run`, seconds apart; each apart, so one failing leaves
        the others' rows. The clips are made (or found) first, outside every timing."""
        self.attempt("video clips", lambda: video.make_clips(self.ctx))
        for row in video.rows(self.ctx.plan):
            self._video(row, "video-peer", video.run_peer)
            self._video(row, "video-kiln", video.run_kiln)

    def _video(
        self, row: video.Row, case: str, fn: Callable[[Context, video.Row], CaseResult]
    ) -> None:
        self.attempt(f"{case} {row.label}", lambda: [fn(self.ctx, row)])

    def _feed(self, subject: str) -> None:
        self.attempt(f"{subject} {FEED_MODEL}", lambda: [feed.run(self.ctx, subject)])


def _line(result: CaseResult) -> str:
    if result.skipped:
        reason = escape(result.skipped)
        return f"[yellow]– {result.case} {result.model}: skipped ({reason})[/yellow]"
    if result.case == "startup":
        x = result.extra
        return (
            f"[green]✓[/green] startup: kiln run --help {x['help_s']} s, a prep process ready "
            f"{x['prep_ready_s']} s, kiln run {result.seconds} s (first result "
            f"{x['first_result_s']} s, {x['first_result_after_engine_s']} s after the engine)"
        )
    if result.case.startswith("standin-"):
        x = result.extra
        busy = x["device_busy_share"]
        return (
            f"[green]✓[/green] {result.case} {result.model}: {result.items_per_s:.0f} rows/s "
            f"(stand-in {x['standin']}, device busy {busy or 0:.0%}), engine "
            f"process {x['engine_cpu_us_per_row']:.0f} µs CPU/row, prep "
            f"{x['prep_cpu_us_per_row']:.0f}"
        )
    latency = f", p50 {result.latency_ms['p50']} ms" if result.latency_ms else ""
    return (
        f"[green]✓[/green] {result.case} {result.model}: {result.items_per_s:.1f} items/s{latency}"
    )


def run_bench(
    plan: Plan, workdir: Path, console: Console
) -> tuple[Context, list[CaseResult], list[str]]:
    ctx = prepare(plan, workdir, console)
    with services_for(ctx, console) as stack:
        ctx.stack = stack
        runner = Runner(ctx, console)
        for model in plan.models:
            runner.model_cases(model)
        runner.global_cases()
    return ctx, runner.results, runner.failures
