"""`kiln admin tenant set|show`: an operator's per-tenant defaults (`tenant_settings`), here the
retention of its jobs' items and results (`--retention 7d`; `none` goes back to the
deployment's KILN_RETENTION)."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.app.cli.common import console, fail, session, settings
from kiln.app.core.errors import KilnError

admin_app = typer.Typer(help="Operator settings.", no_args_is_help=True)
tenant_app = typer.Typer(help="A tenant's defaults.", no_args_is_help=True)
admin_app.add_typer(tenant_app, name="tenant")


@tenant_app.command("set")
def tenant_set(
    tenant: str,
    retention: Annotated[
        str | None,
        typer.Option(
            help='How long its jobs\' items and results are kept after they end ("7d", "12h", '
            "seconds; none: the deployment's KILN_RETENTION)."
        ),
    ] = None,
) -> None:
    """Set TENANT's defaults; options not given are left as they are."""
    from kiln.app.core.durations import optional_duration
    from kiln.app.db.models import TenantSettings, utcnow
    from kiln.app.jobs.retention import check_retention

    current = settings()
    with session() as db:
        row = db.get(TenantSettings, tenant) or TenantSettings(tenant=tenant, share_weight=1.0)
        if retention is not None:
            try:
                keep = optional_duration(retention) is None  # `none`: the deployment's
            except ValueError:
                keep = False  # not a word for "none": check_retention says what is wrong
            try:
                asked = None if keep else check_retention(retention, current, "--retention")
            except KilnError as error:
                raise fail(error) from None
            row.retention_s = asked
        row.updated_at = utcnow()
        db.add(row)
        db.commit()
    tenant_show(tenant)


@tenant_app.command("show")
def tenant_show(tenant: str) -> None:
    """TENANT's defaults (and where the deployment's apply)."""
    from kiln.app.db.models import TenantSettings

    current = settings()
    with session() as db:
        row = db.get(TenantSettings, tenant)
    own = row.retention_s if row is not None else None
    default = f"the deployment's: {_describe(current.retention)}"
    console.print(f"tenant {tenant!r}: {_describe(own) if own is not None else default}")


def _describe(seconds: int | None) -> str:
    from kiln.app.core.durations import describe

    return "results kept for ever" if seconds is None else f"results kept {describe(seconds)}"
