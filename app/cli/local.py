"""`kiln run`: a job on this machine with the embedded defaults, no servers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kiln.app.cli.common import (
    OptionPairs,
    VideoFps,
    console,
    errors,
    fail,
    parse_options,
    settings,
    with_video_fps,
)
from kiln.app.core.errors import InputError, KilnError


def run(
    source: Annotated[
        str,
        typer.Argument(
            help="Images and videos: a folder, a file or a glob. Texts: a file, one per line."
        ),
    ],
    model: Annotated[str, typer.Option(help="Model to run, e.g. ocr or detector.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")] = Path(
        "results.parquet"
    ),
    option: OptionPairs = None,
    video_fps: VideoFps = None,
) -> None:
    """Run a job locally on the embedded defaults (no servers) and write its results. A video
    among the inputs becomes one item per sampled frame (`--video-fps`)."""
    import pyarrow.parquet as pq

    from kiln.app.observability import observe
    from kiln.workers.embedded import run_embedded

    options = with_video_fps(parse_options(option), video_fps)
    current = settings()
    observe(current, "run", logging.WARNING)
    try:
        _check_output(output)
        with _progress(model) as show:
            outcome = run_embedded(current, source, model, show, options)
    except KilnError as error:
        raise fail(error) from None
    pq.write_table(outcome.table, output)
    _summary(outcome, output)


def _check_output(output: Path) -> None:
    """Before the run, not after it: a results file that cannot be written wastes the work."""
    if output.is_dir():
        raise InputError(f"--output {str(output)!r} is a folder; name a .parquet file.")
    try:  # a new folder for the results is what a user of `-o out/results.parquet` means
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(
            f"--output {str(output)!r}: the folder {str(output.parent)!r} cannot be made "
            f"({error.strerror or error})."
        ) from None


@contextmanager
def _progress(model: str) -> Iterator[Callable[[Any], None]]:
    """A bar drawn from the first report on, once the model and inputs are accepted and the
    job submitted, and stopped before any error is printed: a refused run shows its sentence
    and no bar after it."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=errors,
        auto_refresh=False,  # redrawn per report (a chunk, or a second): no 10 Hz thread
    )
    task = bar.add_task(model, total=None, rate="")

    def show(p: Any) -> None:
        bar.start()  # the first report draws it; later calls do nothing
        rate = f"{p.items_per_second:.1f} items/s" if p.items_per_second else ""
        bar.update(task, total=p.counts.total, completed=p.counts.done, rate=rate)
        bar.refresh()

    try:
        yield show
    finally:
        if bar.live.is_started:  # stopping a bar never drawn would still print a blank line
            bar.stop()


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
