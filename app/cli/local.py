"""`kiln run`: a job on this machine with the embedded defaults, no servers.

It always runs here, on the embedded stack under KILN_DATA_DIR, whatever service the
environment names (its files are local: no service worker may read them). Exit status: 0
when the job completed and at least one item succeeded (the summary counts any that failed);
1 when the run was refused, or the job failed, or no item succeeded; 130 on Ctrl-C, which
cancels the job, waits for it to close, and still writes the results of the finished items.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kiln.app.cli.common import OptionPairs, VideoFps, console, errors, fail, job_options, settings
from kiln.app.cli.verdict import Ended, decide
from kiln.app.core.errors import InputError, KilnError

if TYPE_CHECKING:
    from kiln.app.core.config import Settings
    from kiln.workers.prep.pool import Preparer

INTERRUPTED = 130  # the shell's status for a command stopped by Ctrl-C (128 + SIGINT)


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
    """Run a job here, on the embedded stack (SQLite and files under KILN_DATA_DIR; a service
    the environment names is not used), and write its results. A video among the inputs
    becomes one item per sampled frame (`--video-fps`). Ctrl-C cancels the job (twice: quit
    at once). Exits 1 when no item succeeded, 130 when cancelled."""
    options = job_options(option, video_fps)
    given = settings()
    here = given.embedded()
    with _prep_ahead(here, source) as prep:
        # Imported once the prep processes are starting: their imports and these overlap.
        with _no_garbage():
            import pyarrow.parquet as pq

            from kiln.app.observability import observe
            from kiln.workers.embedded import Interrupted, run_embedded

        observe(here, "run", default="WARNING")  # the bar says the rest
        try:
            _check_output(output)
            with _ctrl_c() as cancel, _progress(model, mode_line(given, here), cancel) as show:
                outcome = run_embedded(here, source, model, show, options, cancel, prep)
        except Interrupted:
            errors.print("Interrupted before the job was submitted: nothing ran.")
            raise typer.Exit(INTERRUPTED) from None
        except KilnError as error:
            raise fail(error) from None
    pq.write_table(outcome.table, output)
    _summary(outcome, output)
    code = _verdict(outcome, output)
    # Everything is written and closed: the interpreter's teardown need not walk the objects
    # the stack left behind for cycles (a third of a second, on every run).
    gc.freeze()
    raise typer.Exit(code)


@contextmanager
def _no_garbage() -> Iterator[None]:
    """The stack's imports make ~half a million objects that live as long as the run: no
    cycle collection while they are made (each full one would walk them all), and frozen
    after, so the run's own collections never walk them again."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


@contextmanager
def _prep_ahead(settings: Settings, source: str) -> Iterator[Preparer | None]:
    """The run's prep processes, started before its imports (`prep/ahead.py`); closed on the
    way out if the run never took them over (a refused run), else by the run."""
    from kiln.workers.prep.ahead import start_ahead

    prep = start_ahead(settings, source)
    try:
        yield prep
    finally:
        if prep is not None:
            prep.close()


def mode_line(given: Settings, here: Settings) -> str:
    """Where this run runs, and the service it leaves alone when the environment names one."""
    from kiln.app.core.config import redact_url

    line = f"Running here, embedded (SQLite and files under {_shown(here.data_dir)})"
    names = ("database_url", "broker_url", "storage_url")
    service = [
        redact_url(getattr(given, n)) for n in names if getattr(given, n) != getattr(here, n)
    ]
    if not service:
        return line + "."
    urls = ", ".join(service[:-1]) + (" and " if len(service) > 1 else "") + service[-1]
    return line + f"; the service at {urls} is not used — `kiln submit` sends to it."


def _shown(path: Path) -> str:
    """`path` relative to the working directory where it is inside it (`.kiln`)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@contextmanager
def _ctrl_c() -> Iterator[threading.Event]:
    """SIGINT during the run: the first sets the event (the run cancels its job and waits
    for it to close), the second exits at once (130)."""
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancel  # only the main thread may handle signals; Ctrl-C there stays default
        return

    def handle(_signum: int, _frame: FrameType | None) -> None:
        if cancel.is_set():
            sys.stderr.write("\nQuit at once: items still running are left unfinished.\n")
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(INTERRUPTED)
        cancel.set()

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


def _verdict(outcome: Any, output: Path) -> int:
    """The exit status of a run that ran: 130 when cancelled (Ctrl-C); else as for any job
    waited for (`verdict.decide`: 1 when it failed or nothing succeeded — the results file
    still says why each item failed — else 0), with a sentence on stderr for a 1."""
    c = outcome.progress.counts
    if outcome.cancelled:
        errors.print(
            f"Cancelled (Ctrl-C): {c.succeeded} succeeded, {c.failed} failed, "
            f"{c.cancelled} cancelled"
            + (f", {c.pending} still running and left unfinished" if c.pending else "")
            + f"; the finished items are in {output}.",
            soft_wrap=True,
        )
        return INTERRUPTED
    job = outcome.progress.job
    ended = Ended(job.status, c.total, c.succeeded, c.failed, c.cancelled, job.error)
    decided = decide(ended, results=str(output))
    if decided.code == 0 or decided.sentence is None:
        return decided.code
    said = decided.sentence
    if decided.first_error:
        first = next((e for e in outcome.table.column("error").to_pylist() if e), None)
        said += f" The first error: {first}" if first else ""
    errors.print(f"[red]error:[/red] {escape(said)}", highlight=False, soft_wrap=True)
    return decided.code


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
    existed = output.exists()
    try:  # opened for writing, not os.access: ACLs, read-only mounts, links answer truly
        with output.open("ab"):
            pass
        if not existed:
            output.unlink()
    except OSError as error:
        raise InputError(
            f"--output {str(output)!r} cannot be written ({error.strerror or error}); name "
            "another file."
        ) from None


@contextmanager
def _progress(model: str, mode: str, cancel: threading.Event) -> Iterator[Callable[[Any], None]]:
    """A bar drawn from the first report on, once the model and inputs are accepted and the
    job submitted (the `mode` line just before it), and stopped before any error is printed:
    a refused run shows its sentence and no bar after it. The first report after Ctrl-C says
    the job is being cancelled."""
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
    said: set[str] = set()

    def say(what: str, text: str) -> None:
        if what not in said:
            said.add(what)
            errors.print(text, markup=False, highlight=False, soft_wrap=True)

    def show(p: Any) -> None:
        say("mode", mode)
        if cancel.is_set():
            say(
                "cancel",
                f"Cancelling job {p.job.id[:8]}: no new item starts; waiting for those running "
                "(Ctrl-C again quits at once).",
            )
        bar.start()  # the first report draws it; later calls do nothing
        rate = f"{p.items_per_second:.1f} items/s, " if p.items_per_second else ""
        rate += f"{p.running} running"
        bar.update(task, total=p.counts.total, completed=p.processed, rate=rate)
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
    if c.cancelled or c.pending:  # a line, not a column: the table fits 80 columns as it is
        unfinished = f", {c.pending} left unfinished" if c.pending else ""
        console.print(f"cancelled: {c.cancelled} items{unfinished}")
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
