"""`kiln search JOB --image a.jpg | --text "…" | --key K`: look-alikes in a closed embedding job
(`kiln search --pipeline NAME …`: in a pipeline's library), asked of the API at KILN_API_URL."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kiln.app.cli.common import console, fail
from kiln.app.cli.remote import ApiClient
from kiln.app.core.errors import KilnError


def search(
    job_id: Annotated[str | None, typer.Argument(help="The job to search.")] = None,
    pipeline: Annotated[
        str | None,
        typer.Option("--pipeline", help="Search a pipeline's library (all its runs) instead."),
    ] = None,
    image: Annotated[
        Path | None,
        typer.Option("--image", exists=True, dir_okay=False, help="An image to search with."),
    ] = None,
    text: Annotated[str | None, typer.Option("--text", help="A text (text embedders).")] = None,
    key: Annotated[
        str | None, typer.Option("--key", help="An item of the job: its look-alikes.")
    ] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="How many items to show (1–100).")] = 10,
) -> None:
    """Show the items of a closed embedding job (or of a pipeline's library) most alike to an
    image, a text or an item."""
    if sum(given is not None for given in (image, text, key)) != 1:
        raise fail(KilnError("Give exactly one of --image, --text or --key."))
    if (job_id is None) == (pipeline is None):
        raise fail(KilnError("Give a job to search, or --pipeline NAME (not both)."))
    with ApiClient() as client:
        found = client.search(job_id, pipeline=pipeline, image=image, text=text, key=key, k=k)
    console.print(hits_table(found))


def hits_table(found: dict[str, Any]) -> Table:
    """One row per hit, most alike first; the thumbnail column only for image jobs."""
    hits = found["hits"]
    thumbnails = any(hit.get("thumbnail_url") for hit in hits)
    pipeline = found.get("pipeline")
    searched = f"pipeline {pipeline}" if pipeline else f"job {found['job_id']}"
    table = Table(title=f"{len(hits)} nearest in {searched} ({found['query']} query)")
    table.add_column("#", justify="right")
    table.add_column("key", overflow="fold")
    table.add_column("similarity", justify="right")
    if thumbnails:
        table.add_column("thumbnail", overflow="fold")
    for rank, hit in enumerate(hits, start=1):
        row = [str(rank), hit["key"], f"{hit['similarity']:.4f}"]
        table.add_row(*row, *([hit.get("thumbnail_url") or ""] if thumbnails else []))
    return table
