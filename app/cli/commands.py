"""The `kiln` command's commands (`kiln.app.cli.main` runs them). Each command module imports at
its top only what `kiln --help` needs; what a command uses it imports when it runs."""

from __future__ import annotations

import typer

from kiln.app.cli import admin, bulk, doctor, local, remote, search, serve, storage

app = typer.Typer(help="Kiln: batch inference on GPUs.", no_args_is_help=True)
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.keys_app, name="keys")
app.add_typer(admin.tenants_app, name="tenants")
app.add_typer(admin.models_app, name="models")
app.add_typer(admin.engines_app, name="engines")
app.add_typer(storage.storage_app, name="storage")
app.add_typer(bulk.schedule_app, name="schedule")
app.command("api")(serve.api)
app.command("worker")(serve.worker)
app.command("flower")(serve.flower)
app.command("beat")(serve.beat)
app.command("run")(local.run)
app.command("submit")(remote.submit)
app.command("status")(remote.status)
app.command("results")(remote.results_cmd)
app.command("cancel")(remote.cancel)
app.command("search")(search.search)
app.command("bulk")(bulk.bulk)
app.command("doctor")(doctor.doctor)
