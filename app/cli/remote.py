"""`kiln submit|status|results|cancel`: a client of a Kiln API (KILN_API_URL, KILN_API_KEY)."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from kiln.app import job_counts
from kiln.app.cli import watch_lines
from kiln.app.cli.common import OptionPairs, VideoFps, console, errors, fail, job_options, settings
from kiln.app.core.errors import KilnError


def submit(
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False)],
    model: Annotated[str, typer.Option(help="Model to run.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job finishes.")] = False,
    option: OptionPairs = None,
    video_fps: VideoFps = None,
) -> None:
    """Submit files (images, videos) to the API at KILN_API_URL."""
    options = job_options(option, video_fps)
    with ApiClient() as client:
        job = client.submit(files, model, options)
        total = job["counts"]["total"]
        console.print(f"job {job['id']} {job['status']} ({total} item{'' if total == 1 else 's'})")
        if wait:
            raise typer.Exit(verdict(client, watch(client, job["id"])))


def status(
    job_id: str,
    follow: Annotated[
        bool, typer.Option("--watch", help="Follow with a progress bar, items/s and ETA.")
    ] = False,
) -> None:
    """Show a job's status and counts."""
    with ApiClient() as client:
        if follow:
            raise typer.Exit(verdict(client, watch(client, job_id)))
        _print_job(client.job(job_id))


def results_cmd(
    job_id: str,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Parquet file to write.")
    ] = None,
    urls: Annotated[
        bool, typer.Option("--urls", help="Print presigned URLs instead (S3 storage only).")
    ] = False,
    expires: Annotated[
        int, typer.Option(min=1, max=3600, help="Seconds the --urls stay valid (≤ 3600).")
    ] = 900,
    groups: Annotated[
        bool, typer.Option("--groups", help="Download the closed job's duplicate groups instead.")
    ] = False,
) -> None:
    """Download a job's results (or its duplicate groups) as one Parquet file, or print
    presigned URLs of its files."""
    if not urls and output is None:
        raise fail(KilnError("Give -o FILE to download the results, or --urls for links."))
    with ApiClient() as client:
        if urls:
            signed = client.result_urls(job_id, expires)
            for entry in ([signed["manifest"]] if signed["manifest"] else []) + signed["shards"]:
                typer.echo(f"{entry['key']}\t{entry['url']}")  # plain: for scripts, no wrapping
            return
        assert output is not None
        client.download_results(job_id, output, "groups" if groups else "results")
    console.print(f"{'groups' if groups else 'results'} of {job_id} written to {output}")


def cancel(job_id: str) -> None:
    """Cancel a job; finished results are kept."""
    with ApiClient() as client:
        _print_job(client.cancel(job_id))


class ApiClient:
    def __enter__(self) -> Any:
        from kiln.app.client import KilnClient

        current = settings()
        try:
            self.client = KilnClient(current.api_url, current.api_key)
        except KilnError as error:
            raise fail(error) from None
        return self.client

    def __exit__(self, kind: Any, error: Any, _tb: Any) -> None:
        self.client.close()
        if isinstance(error, KilnError):
            raise fail(error) from None


def verdict(client: Any, job: dict[str, Any]) -> int:
    """The exit status of a job waited for, as `kiln run`'s: 1 (and why, on stderr) when
    it failed, was cancelled or no item succeeded; else 0, failed items and all (the results
    say why each failed)."""
    c = job["counts"]
    if job["status"] == "failed":
        errors.print(f"[red]error:[/red] the job failed: {escape(str(job.get('error')))}")
        return 1
    if job["status"] == "cancelled":
        errors.print(f"The job was cancelled: {c['succeeded']} items succeeded before it was.")
        return 1
    if c["succeeded"] == 0 and c["failed"]:
        first = client.first_error(job["id"])
        reason = f" The first error: {escape(first)}" if first else ""
        errors.print(f"[red]error:[/red] no item succeeded ({c['failed']} failed).{reason}")
        return 1
    return 0


def watch(client: Any, job_id: str) -> dict[str, Any]:
    """Follow the job until it closes, then print its summary: a live bar in a terminal, else
    (cron, `| tee`: where the bar draws nothing) a plain line now and then (`watch_lines`)."""
    job: dict[str, Any] = client.job(job_id)  # before the bar: a job not there is a sentence
    if console.is_terminal and errors.is_terminal:
        job = _bar(client, job)
    else:
        job = watch_lines.follow(lambda: client.job(job_id), job, _log_line)
    _print_job(job)
    return job


def _log_line(line: str) -> None:
    """One line of a log as it is, however long: not wrapped at 80 columns, no markup read."""
    console.print(line, soft_wrap=True, markup=False, highlight=False)


def _bar(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A live bar until the job closes: done of total, items/s and the API's ETA. While a bulk
    job is still listing its bucket, or its videos are being expanded into frames, the total
    grows (and while listing the ETA is unknown)."""
    job_id = job["id"]
    with Progress(
        TextColumn(job_id[:8]),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TextColumn("{task.fields[eta]}"),
        console=errors,
    ) as bar:
        task = bar.add_task("job", total=None, rate="", eta="")
        while True:
            c = job["counts"]
            bar.update(
                task,
                total=None if job.get("listing") else c["total"],
                completed=c["done"],
                rate=_rate(job),
                eta=_eta(job),
            )
            if job["status"] in ("completed", "failed", "cancelled"):
                return job
            time.sleep(0.5)
            job = client.job(job_id)


def _rate(job: dict[str, Any]) -> str:
    """items/s over the last minute, what is running now, and a stall when there is one."""
    running = job["counts"].get("running", 0)
    line = f"{job['items_per_second'] or 0:.1f} items/s, {running} running"
    if job.get("stalled_since"):
        line += f" — stalled since {_clock(job['stalled_since'])} (a worker stopped)"
    if job.get("waiting_for_worker"):
        line += " — no worker is running (start `kiln worker`)"
    return line


def _clock(stamp: str) -> str:
    """An API timestamp as the local wall-clock time."""
    return datetime.fromisoformat(stamp).astimezone().strftime("%H:%M:%S")


def _eta(job: dict[str, Any]) -> str:
    if job.get("listing"):
        skipped = job["counts"].get("skipped", 0)
        return f"listing… ({skipped} unchanged)" if skipped else "listing…"
    eta = job.get("eta_seconds")
    when = "" if eta is None else f"ETA {int(eta) // 60}:{int(eta) % 60:02d}"
    if videos := job["counts"].get("expanding"):  # the total grows by their frames
        return f"expanding {videos} video{'s' if videos != 1 else ''} into frames… {when}".rstrip()
    return when


def _print_job(job: dict[str, Any]) -> None:
    c = job["counts"]
    line = (
        f"job {job['id']} {job['status']}: {c['succeeded']} succeeded, {c['failed']} failed, "
        f"{c.get('running', 0)} running, {c['pending']} pending of {c['total']}"
    )
    if c.get("cancelled"):
        line += f", {c['cancelled']} cancelled"
    if job.get("source"):
        line += f"; {job_counts.left_alone_text(c)}"
    console.print(line, soft_wrap=True)  # one line in a log too, however long
    if job.get("stalled_since"):
        console.print(
            f"[yellow]Stalled since {_clock(job['stalled_since'])}: a worker holding some items "
            "stopped renewing them; kiln beat's reconciler sends them to another worker once "
            "their lease runs out.[/yellow]"
        )
    if job.get("waiting_for_worker"):
        console.print(
            "[yellow]No worker has reported in the last 30 s: the job waits until one starts "
            "(`kiln worker`).[/yellow]"
        )
    if job.get("error"):
        console.print(f"[red]{job['error']}[/red]")
