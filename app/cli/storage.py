"""`kiln storage check`: the operator's check of Kiln's own store (`KILN_STORAGE_URL`)."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.app.cli.common import console, fail, settings
from kiln.app.core.errors import KilnError

storage_app = typer.Typer(help="Kiln's own object store (KILN_STORAGE_URL).", no_args_is_help=True)


@storage_app.command("check")
def storage_check(
    create: Annotated[
        bool, typer.Option("--create", help="Create the bucket if it does not exist.")
    ] = False,
) -> None:
    """Check KILN_STORAGE_URL: the bucket exists and Kiln can write, read and delete there."""
    from kiln.app.storage import open_store
    from kiln.app.storage.check import check_store

    current = settings()
    where = current.storage_url
    if where.startswith("s3://") and current.s3_endpoint_url:
        where += f" at {current.s3_endpoint_url}"
    console.print(f"Kiln's store is {where} (KILN_STORAGE_URL).", soft_wrap=True)
    try:
        for line in check_store(open_store(current), create=create):
            console.print(line, soft_wrap=True)
    except (KilnError, ValueError) as error:  # ValueError: a URL neither s3:// nor file://
        raise fail(error) from None
