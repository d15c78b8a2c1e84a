"""The `kiln` command: run locally, serve, work, administer, and talk to a remote API."""

from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from app.core.config import Settings, get_settings
from app.core.errors import KilnError

app = typer.Typer(help="Kiln: batch inference on GPUs.", no_args_is_help=True)
db_app = typer.Typer(help="Database schema.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
models_app = typer.Typer(help="Models a job can name.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(models_app, name="models")

console = Console()
errors = Console(stderr=True)


def _settings() -> Settings:
    return get_settings()


def _fail(error: Exception) -> typer.Exit:
    errors.print(f"[red]error:[/red] {error}")
    return typer.Exit(1)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Apply database migrations (run once per release, before the API starts)."""
    from app.db.migrate import upgrade

    settings = _settings()
    upgrade(settings)
    console.print(f"database at {_redact(settings.database_url)} is up to date")


@keys_app.command("create")
def keys_create(tenant: Annotated[str, typer.Option(help="Tenant the key acts for.")]) -> None:
    """Create an API key; it is printed once and stored only as a hash."""
    from app.auth import create_key

    with _session() as session:
        try:
            key = create_key(session, tenant)
        except KilnError as error:
            raise _fail(error) from None
        session.commit()
    errors.print(f"key {key.prefix} for tenant {tenant!r} (shown once):")
    console.print(key.secret)


@keys_app.command("revoke")
def keys_revoke(prefix: str) -> None:
    """Revoke a key by the 8-character prefix shown at creation (kiln_<prefix>_…)."""
    from app.auth import revoke_key

    with _session() as session:
        try:
            revoke_key(session, prefix)
        except KilnError as error:
            raise _fail(error) from None
        session.commit()
    console.print(f"key {prefix} revoked")


@models_app.command("add")
def models_add(
    name: str,
    onnx: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="ONNX file.")],
    kind: Annotated[str, typer.Option(help="Model family.")] = "classify",
    input_size: Annotated[int, typer.Option(help="Square input side in pixels.")] = 224,
    labels: Annotated[Path | None, typer.Option(exists=True, help="One label per line.")] = None,
    mean: Annotated[str, typer.Option(help="Per-channel mean, 0-1 scale.")] = "0.485,0.456,0.406",
    std: Annotated[str, typer.Option(help="Per-channel std, 0-1 scale.")] = "0.229,0.224,0.225",
    top_k: Annotated[int, typer.Option(help="Labels kept per image.")] = 5,
) -> None:
    """Register an ONNX model (copied into object storage so every worker can fetch it)."""
    from app.catalog import ClassifierSpec, register_model
    from app.storage import open_store

    label_list = labels.read_text().splitlines() if labels else []
    try:
        spec = ClassifierSpec(
            input_size=input_size,
            labels=[x.strip() for x in label_list if x.strip()],
            mean=_triple(mean),
            std=_triple(std),
            top_k=top_k,
        )
        with _session() as session:
            info = register_model(session, open_store(_settings()), name, onnx, kind, spec)
            session.commit()
    except KilnError as error:
        raise _fail(error) from None
    console.print(f"model {info.name!r} ({info.kind}) registered, sha256 {info.sha256}")


@models_app.command("list")
def models_list() -> None:
    """List built-in and registered models."""
    from app.catalog import list_models

    table = Table("name", "kind", "input", "description")
    with _session() as session:
        for m in list_models(session):
            table.add_row(m.name, m.kind, m.input, m.description)
    console.print(table)


@app.command("api")
def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
) -> None:
    """Serve the HTTP API."""
    import uvicorn

    from app.api.app import create_app

    uvicorn.run(create_app(_settings()), host=host, port=port, log_level="info")


@app.command("worker")
def worker(
    concurrency: Annotated[int | None, typer.Option(help="Task threads.")] = None,
    queues: Annotated[
        str, typer.Option(help="Queues, highest priority first.")
    ] = "interactive,bulk",
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    loglevel: Annotated[str, typer.Option(help="Log level.")] = "INFO",
    metrics_port: Annotated[
        int | None, typer.Option(help="Serve Prometheus metrics on this port.")
    ] = None,
) -> None:
    """Run a worker: task threads feed one Batcher per model in this process."""
    from workers.celery_app import make_celery
    from workers.metrics import serve_metrics, worker_registry

    settings = _settings()
    celery = make_celery(settings)
    node = hostname or f"cpu@{socket.gethostname()}"
    port = metrics_port or settings.worker_metrics_port
    if port:
        serve_metrics(port, worker_registry(celery.batch_stats))
    try:
        celery.Worker(
            pool_cls="threads",
            concurrency=concurrency or settings.task_threads,
            queues=queues.split(","),
            hostname=node,
            loglevel=loglevel,
            send_events=True,
        ).start()
    finally:
        celery.close_runtime()


@app.command("flower")
def flower(port: Annotated[int, typer.Option(help="Port for the Flower UI.")] = 5555) -> None:
    """Flower against the configured broker; refuses to start without authentication."""
    import os

    from workers.celery_app import make_celery

    auth = os.environ.get("KILN_FLOWER_BASIC_AUTH")
    if not auth or ":" not in auth:
        raise _fail(KilnError("Set KILN_FLOWER_BASIC_AUTH=user:password; Flower never runs open."))
    make_celery(_settings()).start(["flower", f"--port={port}", f"--basic-auth={auth}"])


@app.command("beat")
def beat(loglevel: Annotated[str, typer.Option(help="Log level.")] = "INFO") -> None:
    """Run the scheduler for Kiln's periodic tasks (one per deployment)."""
    from workers.celery_app import make_celery

    settings = _settings()
    schedule = settings.data_dir / "beat-schedule"
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    make_celery(settings).Beat(loglevel=loglevel, schedule=str(schedule)).run()


@app.command("run")
def run(
    source: Annotated[str, typer.Argument(help="A folder, a file, or a glob of images.")],
    model: Annotated[str, typer.Option(help="Model to run, e.g. ocr or detector.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")] = Path(
        "results.parquet"
    ),
) -> None:
    """Run a job locally on the embedded defaults (no servers) and write its results."""
    import pyarrow.parquet as pq

    from workers.embedded import run_embedded

    logging.basicConfig(level=logging.WARNING)
    settings = _settings()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=errors) as bar:
        task = bar.add_task(f"{model}", total=None, rate="")

        def show(p: Any) -> None:
            rate = f"{p.items_per_second:.1f} items/s" if p.items_per_second else ""
            bar.update(task, total=p.counts.total, completed=p.counts.done, rate=rate)

        try:
            outcome = run_embedded(settings, source, model, show)
        except KilnError as error:
            raise _fail(error) from None
    pq.write_table(outcome.table, output)
    _summary(outcome, output)


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
    return ""


@app.command("submit")
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


@app.command("status")
def status(
    job_id: str, watch: Annotated[bool, typer.Option(help="Follow with a progress bar.")] = False
) -> None:
    """Show a job's status and counts."""
    with _client() as client:
        if watch:
            _watch(client, job_id)
        else:
            _print_job(client.job(job_id))


@app.command("results")
def results_cmd(
    job_id: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Parquet file to write.")],
) -> None:
    """Download a job's results as one Parquet file."""
    with _client() as client:
        output.write_bytes(client.results(job_id))
    console.print(f"results of {job_id} written to {output}")


@app.command("cancel")
def cancel(job_id: str) -> None:
    """Cancel a job; finished results are kept."""
    with _client() as client:
        _print_job(client.cancel(job_id))


class _client:
    def __enter__(self) -> Any:
        from app.client import KilnClient

        settings = _settings()
        try:
            self.client = KilnClient(settings.api_url, settings.api_key)
        except KilnError as error:
            raise _fail(error) from None
        return self.client

    def __exit__(self, kind: Any, error: Any, _tb: Any) -> None:
        self.client.close()
        if isinstance(error, KilnError):
            raise _fail(error) from None


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


def _session() -> Any:
    from app.db.session import make_engine, make_session_factory

    settings = _settings()
    if settings.database_url.startswith("sqlite"):
        from app.db.migrate import upgrade

        upgrade(settings)  # the embedded default prepares its own database, as `kiln run` does
    return make_session_factory(make_engine(settings.database_url))()


def _triple(text: str) -> tuple[float, float, float]:
    values = [float(v) for v in text.split(",")]
    if len(values) != 3:
        raise KilnError(f"{text!r} must be three comma-separated numbers.")
    return (values[0], values[1], values[2])


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
