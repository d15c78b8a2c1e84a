"""`kiln submit|status|results|cancel`: a client of a Kiln API (KILN_API_URL, KILN_API_KEY)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from app.cli.common import console, errors, fail, settings
from app.core.errors import KilnError


def submit(
    files: Annotated[list[Path], typer.Argument(exists=True, dir_okay=False)],
    model: Annotated[str, typer.Option(help="Model to run.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job finishes.")] = False,
) -> None:
    """Submit files to the API at KILN_API_URL."""
    with _client() as client:
        job = client.submit(files, model)
        console.print(f"job {job['id']} {job['status']} ({job['counts']['total']} items)")
        if wait:
            _watch(client, job["id"])


def status(
    job_id: str, watch: Annotated[bool, typer.Option(help="Follow with a progress bar.")] = False
) -> None:
    """Show a job's status and counts."""
    with _client() as client:
        if watch:
            _watch(client, job_id)
        else:
            _print_job(client.job(job_id))


def results_cmd(
    job_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")],
) -> None:
    """Download a job's results as one Parquet file."""
    with _client() as client:
        output.write_bytes(client.results(job_id))
    console.print(f"results of {job_id} written to {output}")


def cancel(job_id: str) -> None:
    """Cancel a job; finished results are kept."""
    with _client() as client:
        _print_job(client.cancel(job_id))


class _client:
    def __enter__(self) -> Any:
        from app.client import KilnClient

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


def _watch(client: Any, job_id: str) -> None:
    with Progress(
        TextColumn(job_id[:8]),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=errors,
    ) as bar:
        task = bar.add_task("job", total=None, rate="")
        while True:
            job = client.job(job_id)
            done = job["counts"]["total"] - job["counts"]["pending"]
            rate = f"{job['items_per_second'] or 0:.1f} items/s"
            bar.update(task, total=job["counts"]["total"], completed=done, rate=rate)
            if job["status"] in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.5)
    _print_job(job)


def _print_job(job: dict[str, Any]) -> None:
    c = job["counts"]
    console.print(
        f"job {job['id']} {job['status']}: {c['succeeded']} succeeded, {c['failed']} failed, "
        f"{c['pending']} pending of {c['total']}"
    )
