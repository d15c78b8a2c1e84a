"""`python -m bench` / `make bench`: Kiln against the raw engine and its peers, in one run."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from bench import report
from bench.plan import ALL_CASES, MODELS, PRESETS
from bench.results import targets
from bench.run import run_bench

HERE = Path(__file__).parent
app = typer.Typer(add_completion=False)


def _csv(text: str | None, allowed: tuple[str, ...], what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = set(chosen) - set(allowed)
    if unknown:
        raise typer.BadParameter(f"unknown {what} {sorted(unknown)}; choose from {allowed}")
    return chosen


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("KILN_"):
        raise typer.BadParameter(f"{text!r}: use --set KILN_NAME=value")
    return name, value


@app.command()
def bench(
    quick: Annotated[
        bool, typer.Option(help="Small sizes, ResNet-18 only: a few minutes.")
    ] = False,
    smoke: Annotated[bool, typer.Option(help="Tiny sizes; checks the harness runs.")] = False,
    images: Annotated[int | None, typer.Option(help="JPEGs per model case.")] = None,
    cases: Annotated[
        str | None, typer.Option(help=f"Comma-separated: {','.join(ALL_CASES)}")
    ] = None,
    models: Annotated[str | None, typer.Option(help=f"Comma-separated: {','.join(MODELS)}")] = None,
    workdir: Annotated[Path, typer.Option(help="Generated inputs, models, logs.")] = Path(
        ".kiln/bench"
    ),
    results_dir: Annotated[Path, typer.Option(help="Where the JSON goes.")] = HERE / "results",
    readme: Annotated[bool, typer.Option(help="Update bench/README.md and chart.png.")] = True,
    video_seconds: Annotated[
        float | None, typer.Option(help="Length of the `video` case's clip (600; 20 --quick).")
    ] = None,
    detector_every_frame_seconds: Annotated[
        float | None,
        typer.Option(help="`video`: the detector at every frame runs on a clip this long (60)."),
    ] = None,
    kiln_set: Annotated[
        list[str] | None,
        typer.Option("--set", help="KILN_NAME=value for every Kiln process (repeatable)."),
    ] = None,
) -> None:
    """Run the benchmark cases, print the table, write JSON (and the README section)."""
    console = Console()
    plan = PRESETS["smoke" if smoke else "quick" if quick else "default"]
    changes: dict[str, object] = {}
    if images:
        changes["images"] = images
    if (chosen := _csv(cases, ALL_CASES, "cases")) is not None:
        changes["cases"] = chosen
    if (chosen := _csv(models, MODELS, "models")) is not None:
        changes["models"] = chosen
    lengths = {
        "video_seconds": video_seconds,
        "detector_every_frame_seconds": detector_every_frame_seconds,
    }
    changes |= {name: seconds for name, seconds in lengths.items() if seconds}
    if kiln_set:
        changes["kiln_env"] = (*plan.kiln_env, *(_setting(s) for s in kiln_set))
    plan = plan.with_(**changes)
    ctx, results, failures = run_bench(plan, workdir.resolve(), console)
    max_batch = ctx.stack.settings.batch_cap(on_gpu=False) if ctx.stack else 16
    goals = targets(results, list(plan.models), max_batch)
    console.print(report.rich_table(results))
    for goal in goals:
        console.print(f"{goal.name}: {goal.value} (goal {goal.goal}) → {report._verdict(goal)}")
    info = report.machine()
    command = "python -m bench " + " ".join(sys.argv[1:])
    payload = {
        "machine": info,
        "plan": asdict(plan),
        "command": command,
        "results": [r.as_dict() for r in results],
        "targets": [asdict(g) for g in goals],
        "failures": failures,
    }
    path = report.write_json(results_dir, payload)
    console.print(f"results: {path}")
    if readme:
        report.chart(results, HERE / "chart.png")
        report.update_readme(HERE / "README.md", report.markdown(results, goals, info, command))
        console.print(f"updated {HERE / 'README.md'} and {HERE / 'chart.png'}")
    if failures:
        console.print(f"[red]{len(failures)} case(s) failed:[/red]")
        for failure in failures:
            console.print(f"  {failure}")
        raise typer.Exit(1)


def main() -> None:
    app()
