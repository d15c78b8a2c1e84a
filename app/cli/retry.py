"""`kiln retry JOB`: replay a closed job's failed items (and with --cancelled its cancelled ones)
as a new job, through the API (`POST /v1/jobs/{id}/retry`)."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.app.cli.common import console
from kiln.app.cli.remote import ApiClient, verdict, watch


def retry(
    job_id: Annotated[str, typer.Argument(help="The job whose failed items to run again.")],
    cancelled: Annotated[
        bool, typer.Option("--cancelled", help="Run its cancelled items again too.")
    ] = False,
    model: Annotated[
        str | None, typer.Option(help="Another model (default: the job's exact version).")
    ] = None,
    key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="The same key again answers the same retry."),
    ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the new job until it ends.")] = False,
) -> None:
    """Run a finished job's failed items again as a new job (same model version and options);
    the two jobs name each other (`retry_of`, `retries`)."""
    with ApiClient() as client:
        job = client.retry(job_id, cancelled, model, key)
        total = job["counts"]["total"]
        console.print(
            f"job {job['id']} {job['status']} ({total} item{'' if total == 1 else 's'}), "
            f"retrying {job['retry_of']}"
        )
        if wait:
            raise typer.Exit(verdict(client, watch(client, job["id"])))
