"""The `kiln` command's commands (`kiln.app.cli.main` runs them). Each command module imports at
its top only what `kiln --help` needs; what a command uses it imports when it runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from kiln.app.cli import admin, bulk, doctor, local, remote, search, serve, storage, tenant_admin

app = typer.Typer(
    help="Kiln: batch inference on GPUs.", no_args_is_help=True, rich_markup_mode="markdown"
)
GROUPS = {
    "db": admin.db_app,
    "keys": admin.keys_app,
    "tenants": admin.tenants_app,
    "models": admin.models_app,
    "engines": admin.engines_app,
    "storage": storage.storage_app,
    "schedule": bulk.schedule_app,
    "admin": tenant_admin.admin_app,
}
COMMANDS: dict[str, Callable[..., Any]] = {
    "api": serve.api,
    "worker": serve.worker,
    "flower": serve.flower,
    "beat": serve.beat,
    "run": local.run,
    "submit": remote.submit,
    "jobs": remote.jobs_cmd,
    "status": remote.status,
    "results": remote.results_cmd,
    "cancel": remote.cancel,
    "search": search.search,
    "bulk": bulk.bulk,
    "doctor": doctor.doctor,
}
for name, group in GROUPS.items():
    app.add_typer(group, name=name)
for name, command in COMMANDS.items():
    app.command(name)(command)
