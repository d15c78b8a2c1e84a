"""`kiln run`: a job on this machine with the embedded defaults, no servers."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kiln.app.cli.common import console, errors, fail, settings
from kiln.app.core.errors import KilnError


def run(
    source: Annotated[
        str, typer.Argument(help="Images: a folder, a file or a glob. Texts: a file, one per line.")
    ],
    model: Annotated[str, typer.Option(help="Model to run, e.g. ocr or detector.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")] = Path(
        "results.parquet"
    ),
) -> None:
    """Run a job locally on the embedded defaults (no servers) and write its results."""
    import pyarrow.parquet as pq

    from kiln.app.observability import observe
    from kiln.workers.embedded import run_embedded

    current = settings()
    observe(current, "run", logging.WARNING)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=errors) as bar:
        task = bar.add_task(f"{model}", total=None, rate="")

        def show(p: Any) -> None:
            rate = f"{p.items_per_second:.1f} items/s" if p.items_per_second else ""
            bar.update(task, total=p.counts.total, completed=p.counts.done, rate=rate)

        try:
            outcome = run_embedded(current, source, model, show)
        except KilnError as error:
            raise fail(error) from None
    pq.write_table(outcome.table, output)
    _summary(outcome, output)


def _summary(outcome: Any, output: Path) -> None:
    c = outcome.progress.counts
    table = Table("job", "status", "total", "succeeded", "failed", "items/s", "seconds")
    rate = c.done / outcome.seconds if outcome.seconds else 0.0
    table.add_row(
        outcome.job_id[:8],
        outcome.progress.job.status,
        str(c.total),
        str(c.succeeded),
        str(c.failed),
        f"{rate:.2f}",
        f"{outcome.seconds:.2f}",
    )
    console.print(table)
    console.print(f"results: {output} ({outcome.table.num_rows} rows)")
    preview = Table("key", "status", "result", title="first results")
    for row in outcome.table.slice(0, 10).to_pylist():
        preview.add_row(row["key"], row["status"], _brief(row))
    console.print(preview)


def _brief(row: dict[str, Any]) -> str:
    if row.get("error"):
        return str(row["error"])
    if row.get("text") is not None:
        return " | ".join(row["text"].splitlines())[:100]
    if row.get("detections") is not None:
        return ", ".join(f"{d['label']} {d['score']:.2f}" for d in row["detections"][:5]) or "none"
    if row.get("labels") is not None:
        return ", ".join(f"{d['label']} {d['score']:.2f}" for d in row["labels"][:3])
    if row.get("embedding") is not None:
        head = ", ".join(f"{v:.3f}" for v in row["embedding"][:4])
        return f"{len(row['embedding'])}-d vector [{head}, …]"
    if row.get("phash") is not None:
        group = row.get("group")
        return str(row["phash"]) + (
            f"  (near-duplicate group {group})" if group is not None else ""
        )
    return ""
