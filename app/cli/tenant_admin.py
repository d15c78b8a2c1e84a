"""`kiln admin tenant set|show`: an operator's per-tenant settings (`tenant_settings`). Here, the
tenant's weight in the bulk queue's fair share (app/jobs/fair_share.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.app.cli.common import console, fail, session
from kiln.app.core.errors import KilnError

admin_app = typer.Typer(help="Operator settings.", no_args_is_help=True)
tenant_app = typer.Typer(help="One tenant's settings.", no_args_is_help=True)
admin_app.add_typer(tenant_app, name="tenant")


@tenant_app.command("set")
def tenant_set(
    name: str,
    weight: Annotated[
        float | None,
        typer.Option(
            help="Its weight in the bulk queue's fair share (1 = equal; 2 = twice another's "
            "share while both have bulk work)."
        ),
    ] = None,
) -> None:
    """Change TENANT's settings; what is not named stays as it was."""
    from kiln.app.tenants.shares import set_weight

    if weight is None:
        raise fail(ValueError("Name a setting to change (--weight)."))
    with session() as db:
        try:
            row = set_weight(db, name, weight)
        except KilnError as error:
            raise fail(error) from None
    console.print(f"tenant {name!r}: fair-share weight {row.share_weight:g}")


@tenant_app.command("show")
def tenant_show(name: str) -> None:
    """TENANT's settings (the deployment's defaults where it has none)."""
    from kiln.app.tenants.shares import weight_of

    with session() as db:
        weight = weight_of(db, name)
    console.print(f"tenant {name!r}: fair-share weight {weight:g}")
